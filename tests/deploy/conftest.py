"""Fixtures of the deployment tests: the helm binary (fetched once per cache, see
``helm_tool``) and the chart rendered once per values case."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.deploy import chart
from tests.deploy.helm_tool import find_helm


@pytest.fixture(scope="session")
def helm() -> Path:
    path, why_not = find_helm()
    if path is None:
        pytest.skip(f"helm tests skipped: {why_not}")
    return path


@pytest.fixture(scope="session")
def rendered(helm: Path) -> Callable[[str], list[dict]]:
    """``rendered(case)`` → the objects of ``chart.CASES[case]``, rendered once a session."""
    cache: dict[str, list[dict]] = {}

    def get(case: str) -> list[dict]:
        if case not in cache:
            cache[case] = chart.render(helm, chart.CASES[case])
        return cache[case]

    return get


# the Redis fixtures and the process leak check of the cluster-state tests
from tests.cluster.conftest import no_leaks, raw_redis, redis_server  # noqa: E402, F401
