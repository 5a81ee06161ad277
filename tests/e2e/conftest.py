"""Fixtures of the whole-cluster tests: one cluster per module, a client per test, and the
one leak check every test ends with.

A module says what cluster it needs in ``CLUSTER``, ``start_cluster``'s keyword arguments
(default: one prefill and one decode worker, TP 1); the ``cluster`` fixture starts it once
for the module. After every test, each ``Cluster`` the test used is checked to hold
nothing (``Cluster.assert_no_leaks``: every live worker's blocks, pins, transfers,
attempts and leases, every live router's requests, attempts, leases and pending aborts,
and Redis's keys), retried while freeing is under way for up to the module's
``IDLE_TIMEOUT_S`` (default 15 s).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdserve.client import Client
from tests.e2e.cluster import Cluster, start_cluster

DEFAULT_LAYOUT: dict[str, Any] = {"num_prefill": 1, "num_decode": 1, "decode_tp": 1}


@pytest.fixture(scope="module")
def cluster(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory,
            request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """The module's cluster (its ``CLUSTER`` layout), started once, stopped at the end."""
    layout = {**DEFAULT_LAYOUT, **getattr(request.module, "CLUSTER", {})}
    name = request.module.__name__.rpartition(".")[2].removeprefix("test_")
    with start_cluster(llama_dir, tmp_path_factory.mktemp(name), **layout) as c:
        yield c


@pytest.fixture
def client(cluster: Cluster) -> Iterator[Client]:
    """An SDK client of the module's cluster's router."""
    with Client(cluster.address) as c:
        yield c


@pytest.fixture(autouse=True)
def ends_idle(request: pytest.FixtureRequest) -> Iterator[None]:
    """The leak check every whole-cluster test ends with (see the module docstring)."""
    yield
    timeout_s = getattr(request.module, "IDLE_TIMEOUT_S", 15.0)
    for value in getattr(request.node, "funcargs", {}).values():
        if isinstance(value, Cluster) and value.redis.running:
            value.assert_no_leaks(timeout_s=timeout_s)
