"""PNG plots of the serving benchmarks (matplotlib, headless): CDFs of TTFT and TPOT, and
SLO attainment against the request rate."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from sim.metrics import Outcome


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    ordered = sorted(values)
    return ordered, [(i + 1) / len(ordered) for i in range(len(ordered))]


def cdf_plots(out_dir: str | Path, runs: Mapping[str, Sequence[Outcome]], *, title: str = "",
              slo_ms: Mapping[str, float] | None = None) -> list[Path]:
    """``ttft_cdf.png`` and ``tpot_cdf.png`` in ``out_dir``, one curve per run (label →
    outcomes), the SLO as a vertical line when given; returns the paths."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for metric, label in (("ttft", "time to first token (ms)"),
                          ("tpot", "time per output token (ms)")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, outcomes in runs.items():
            values = [getattr(o, metric) * 1000 for o in outcomes
                      if o.success and getattr(o, metric) is not None]
            if values:
                ax.step(*_cdf(values), where="post", label=f"{name} (n={len(values)})")
        if slo_ms and metric in slo_ms:
            ax.axvline(slo_ms[metric], color="grey", linestyle="--", label="SLO")
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_title(f"{metric.upper()} CDF {title}".strip())
        fig.tight_layout()
        path = out / f"{metric}_cdf.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def attainment_plot(path: str | Path, arms: Mapping[str, Sequence[tuple[float, float]]], *,
                    title: str = "", threshold: float = 0.9) -> Path:
    """SLO attainment (0..1) against the request rate, one line per arm (label → [(rate,
    attainment)]), the threshold dashed."""
    plt = _pyplot()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in arms.items():
        ax.plot([r for r, _ in points], [a for _, a in points], marker="o", label=name)
    ax.axhline(threshold, color="grey", linestyle="--", label=f"{threshold:.0%}")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
