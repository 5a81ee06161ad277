"""What the Ray launcher tests share: the processes a cluster left, the leak check after
a stop, a steady client load, and ``engine.LLM``'s greedy output to compare with."""

from __future__ import annotations

import importlib.util
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from deploy.ray.plan import NAMESPACE
from tests.factories import PROMPTS
from tests.processes import alive, wait_until

NEEDS_RAY = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="Ray is not installed: pip install 'pdserve[server,ray]' "
                                      "(make setup installs it)")
GPU = "pdserve_gpu"  # stands in for GPUs: every worker's TP group reserves it per rank
TIMEOUT_S = 60.0


def descendants(pid: int) -> list[int]:
    from tests.processes import children

    found, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        found += kids
        todo += kids
    return found


def our_processes(statuses: dict[str, Any]) -> list[int]:
    """Every actor of the cluster and every process below it (children, ranks)."""
    pids = [s.actor_pid for s in statuses.values()]
    return sorted({p for pid in pids for p in [pid, *descendants(pid)]})


def assert_nothing_left(ray: Any, pids: list[int], log_dir: Path) -> None:
    """No actor of ours, no placement group still placed, every resource free again; none
    of ``pids`` alive, no actor process left under Ray, no process naming ``log_dir``."""
    def named() -> list[dict[str, str]]:
        return [a for a in ray.util.list_named_actors(all_namespaces=True)
                if a["namespace"] == NAMESPACE]

    wait_until(lambda: not named(), 30.0, "every actor to go")
    states = {pg["name"]: pg["state"] for pg in ray.util.placement_group_table().values()}
    wait_until(lambda: set(_group_states(ray).values()) <= {"REMOVED"}, 30.0,
               f"every placement group to be removed: {states}")
    wait_until(lambda: _free(ray) == _total(ray), 30.0, "every resource to be free")
    wait_until(lambda: not processes_left(pids, log_dir), 30.0, "every process to exit")


def _group_states(ray: Any) -> dict[str, str]:
    return {pg["name"]: pg["state"] for pg in ray.util.placement_group_table().values()}


def processes_left(pids: list[int], log_dir: Path) -> list[str]:
    """Processes of ours still alive: of ``pids``; actor processes under this test's Ray;
    any process whose command line names ``log_dir`` (the children's ready files)."""
    from tests.processes import children

    left = [f"{p} {cmdline(p)!r}" for p in pids if alive(p)]
    actors = (b"ray::SupervisedChild", b"ray::RedisActor")
    left += [f"{p} {cmdline(p)!r}" for p in descendants(os.getpid())
             if cmdline(p).startswith(actors) and alive(p)]
    marker = str(log_dir).encode()
    left += [f"{p} {cmdline(p)!r}" for p in map(int, filter(str.isdigit, os.listdir("/proc")))
             if marker in cmdline(p) and alive(p) and p not in children(os.getpid())]
    return left


def _free(ray: Any) -> dict[str, float]:
    return {k: ray.available_resources().get(k, 0.0) for k in ("CPU", GPU)}


def _total(ray: Any) -> dict[str, float]:
    return {k: ray.cluster_resources()[k] for k in ("CPU", GPU)}


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


class Load:
    """Two clients sending unique prompts (the prefix cache hides nothing), 4 a second
    each at most, while in the ``with`` block: ``done`` prompt → tokens, ``failures``."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.done: dict[str, list[int]] = {}
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                         for i in range(2)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(TIMEOUT_S)

    def _run(self, index: int) -> None:
        from pdserve.client import Client

        with Client(self.address) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                prompt = f"{PROMPTS[0]} request {n} of client {index}"
                try:
                    self.done[prompt] = list(client.complete(
                        prompt, max_tokens=6, temperature=0, timeout=TIMEOUT_S).token_ids)
                except Exception as exc:  # noqa: BLE001 - reported by the test
                    self.failures.append(repr(exc))
                self._stop.wait(0.25)


def greedy(prompts: list[str], llm: Any, max_tokens: int = 6) -> list[list[int]]:
    from engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [r.token_ids for r in llm.generate(prompts, params)]


def complete_all(address: str, prompts: list[str], max_tokens: int = 6) -> list[list[int]]:
    from pdserve.client import Client

    with Client(address) as client, ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda p: list(client.complete(
            p, max_tokens=max_tokens, temperature=0, ignore_eos=True, timeout=TIMEOUT_S
        ).token_ids), prompts))
