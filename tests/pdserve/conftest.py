"""Fixtures for the cluster-state tests: a private redis-server per test, and a leak check.

The leak check runs after every test in this directory: every child process a test
started (redis-server included) is gone, and no heartbeat thread is left running.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis

from pdserve.redis_server import RedisServer


def child_pids() -> set[int]:
    """Direct children of this process, zombies included (an unreaped child is a leak)."""
    me = os.getpid()
    children = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == me:  # field 4: ppid
            children.add(int(entry))
    return children


def process_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(predicate: Callable[[], object], timeout_s: float, interval_s: float = 0.02
               ) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True


def _heartbeat_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("pdserve-heartbeat")]


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    before = child_pids()
    yield
    assert wait_until(lambda: not (child_pids() - before) and not _heartbeat_threads(), 5.0), (
        f"leaked child processes {sorted(child_pids() - before)}, "
        f"heartbeat threads {_heartbeat_threads()}")


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
