"""``bench.serve`` on a simulated cluster: the same workloads, arrivals and table, no model.

``pdserve simulate`` is the shipped command (``sim.cli``), with the same flags; this module
adds ``--validate``, which runs real clusters and the simulator on the same requests and
reports the error of each metric (``bench.sim_validation``):

    python -m bench.simulate --profile profile.json --prefill 2 --decode 2 \\
        --dataset-name sharegpt-like --num-prompts 1000 --request-rate 8 \\
        --goodput ttft:2000 tpot:100 --json sim.json
    python -m bench.simulate --validate --profile profile.json --json validation.json

``--profile``: a ``sim.profile`` JSON (``python -m bench.profile`` measures one). Without
``--validate`` it prints and writes what ``pdserve simulate`` does (``sim.cli``'s docstring
says what each flag means).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sim.cli import (
    add_simulation_args,
    add_workload_args,
    check_simulation_args,
    load_profile,
    simulate,
)
from sim.metrics import write_json  # bench.common's own, without importing torch
from sim.profile import ProfileError


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.simulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_simulation_args(p)
    add_workload_args(p)
    p.add_argument("--validate", action="store_true",
                   help="compare with real clusters instead (bench.sim_validation)")
    p.add_argument("--validate-rates", default="1,2,3", help="request rates to validate at")
    p.add_argument("--model", type=Path, help="--validate: the profile's checkpoint "
                                               "(default: bench55m; --quick: the tiny model)")
    p.add_argument("--quick", action="store_true", help="--validate: one small point")
    args = check_simulation_args(p, p.parse_args(argv))
    try:
        args.validate_rates = [float(r) for r in args.validate_rates.split(",") if r]
    except ValueError:
        p.error(f"--validate-rates takes rates separated by commas, got {args.validate_rates!r}")
    return args


def validate(args: argparse.Namespace) -> dict[str, Any]:
    from bench.sim_validation import validate as run_validation

    report = run_validation(load_profile(args), args.model, quick=args.quick,
                            rates=args.validate_rates, num_prompts=args.num_prompts,
                            seed=args.seed)
    print("MAPE below saturation: " + ", ".join(
        f"{k} {v:.1%}" for k, v in report["mape"].items() if v is not None))
    print(f"goal ({report['goal']}): {'met' if report['goal_met_below_saturation'] else 'not met'}")
    if args.json:
        write_json(args.json, report)
    return report


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    try:
        return validate(args) if args.validate else simulate(args)
    except ProfileError as exc:
        raise SystemExit(f"bench.simulate: {exc}") from None


if __name__ == "__main__":
    main()
