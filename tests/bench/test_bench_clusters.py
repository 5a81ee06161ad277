"""``bench.clusters.log_folder``: a benchmark cluster's logs go when it is done with them,
and stay (named) when it fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.clusters import log_folder


def test_the_logs_of_a_run_that_ends_are_removed() -> None:
    with log_folder() as logs:
        (logs / "router.log").write_text("served\n")
        assert logs.is_dir()
    assert not logs.exists()


def test_the_logs_of_a_run_that_fails_are_kept_and_named(capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    kept: Path | None = None
    with pytest.raises(RuntimeError), log_folder() as logs:
        kept = logs
        (logs / "decode-0.log").write_text("Traceback ...\n")
        raise RuntimeError("the cluster failed")
    assert kept is not None and (kept / "decode-0.log").exists()
    assert str(kept) in capsys.readouterr().err
    for path in kept.iterdir():
        path.unlink()
    kept.rmdir()
