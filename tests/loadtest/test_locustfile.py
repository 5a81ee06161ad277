"""``loadtest/locustfile.py`` against ``pdserve up`` (``LocalLauncher``): a headless locust
run on each API, about 10 s in all, records TTFT, TPOT and E2E entries and no failure; a
request the router refuses is one failed E2E entry that names its status. Figures are
not checked (they are noise on a shared machine); counts and names are."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.local import LocalLauncher
from tests.factories import REPO_ROOT

pytestmark = pytest.mark.timeout(240)

LOCUST = Path(sys.executable).with_name("locust")
if not LOCUST.exists():  # pragma: no cover - make setup installs the loadtest extra
    pytest.skip(f"locust is not installed next to {sys.executable}: "
                "pip install -e '.[loadtest]' (make setup does)", allow_module_level=True)


def _locust(tmp: Path, host: str, seconds: int, *extra: str) -> dict[tuple[str, str], dict]:
    """Runs locust headless; returns its stats CSV rows by (request type, name)."""
    prefix = tmp / "run"
    result = subprocess.run(
        [str(LOCUST), "-f", "loadtest/locustfile.py", "--headless", "-u", "8", "-r", "8",
         "-t", f"{seconds}s", "--host", host, "--csv", str(prefix), "--only-summary",
         "--stop-timeout", "10", *extra],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    rows = {}
    with open(f"{prefix}_stats.csv", newline="") as f:
        for row in csv.DictReader(f):
            rows[(row["Type"], row["Name"])] = row
    rows[("", "exit")] = {"code": result.returncode, "log": result.stderr[-3000:]}
    return rows


def _check_clean(rows: dict[tuple[str, str], dict], name: str) -> None:
    assert rows[("", "exit")]["code"] == 0, rows[("", "exit")]["log"]
    for kind in ("TTFT", "TPOT", "E2E"):
        row = rows[(kind, name)]
        assert int(row["Request Count"]) > 0, (kind, row)
        assert int(row["Failure Count"]) == 0, (kind, row)
        assert float(row["Median Response Time"]) > 0, (kind, row)
    count = int(rows[("TTFT", name)]["Request Count"])
    assert int(rows[("E2E", name)]["Request Count"]) == count  # one of each per request
    assert float(rows[("TTFT", name)]["Average Response Time"]) <= float(
        rows[("E2E", name)]["Average Response Time"])


def test_grpc_user_records_ttft_tpot_e2e(up: LocalLauncher, tmp_path: Path) -> None:
    # no class named: the grpc:// scheme picks GrpcStreamUser
    rows = _locust(tmp_path, f"grpc://{up.router_address}", 6, "--workload", "shared-prefix",
                   "--input-len", "16", "--prefix-len", "64", "--output-len", "8")
    _check_clean(rows, "shared-prefix")


def test_openai_user_records_ttft_tpot_e2e(up: LocalLauncher, tmp_path: Path) -> None:
    rows = _locust(tmp_path, up.http_url, 4, "OpenAIStreamUser", "--workload",
                   "sharegpt-like", "--vocab-size", "700")
    _check_clean(rows, "sharegpt-like")


def test_a_refused_request_is_a_failed_e2e_entry_with_its_status(
        up: LocalLauncher, tmp_path: Path) -> None:
    rows = _locust(tmp_path, f"grpc://{up.router_address}", 2, "--input-len", "5000")
    assert rows[("", "exit")]["code"] != 0  # locust's exit code says requests failed
    e2e = rows[("E2E", "fixed")]
    assert int(e2e["Failure Count"]) == int(e2e["Request Count"]) > 0
    assert ("TTFT", "fixed") not in rows
    failures = (tmp_path / "run_failures.csv").read_text()
    assert "INVALID_ARGUMENT" in failures and "context length" in failures

