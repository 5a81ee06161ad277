"""Fixtures of the tests that need Redis: a private redis-server per test, and a leak check.

The leak check runs after every test in this directory: every child process a test
started (redis-server included) is gone, and no heartbeat thread is left running.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest
import redis

from deploy.redis_server import RedisServer
from tests.processes import children, wait_until


def _heartbeat_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("pdserve-heartbeat")]


def _leaked(before: set[int]) -> str | None:
    """The cluster layer's leak check: what this test left running beyond ``before``."""
    pids, threads = set(children(os.getpid())) - before, _heartbeat_threads()
    if pids or threads:
        return f"leaked child processes {sorted(pids)}, heartbeat threads {threads}"
    return None


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    before = set(children(os.getpid()))
    yield
    try:
        wait_until(lambda: _leaked(before) is None, 5.0, "no leaked process or thread")
    except AssertionError:
        raise AssertionError(_leaked(before)) from None


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A fresh, empty, password-less redis-server on 127.0.0.1 (stopped afterwards)."""
    with RedisServer(start_timeout_s=10.0) as server:
        yield server


@pytest.fixture
def raw_redis(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A plain client of ``redis_server`` for poking at keys directly."""
    client = redis.Redis.from_url(redis_server.url, socket_timeout=2, socket_connect_timeout=2,
                                  decode_responses=True)
    yield client
    client.close()
