"""Agents (rank processes) shared by the kvtransfer tests, and the leak check that runs
after every test that used them: no channels beyond the bound, no pending transfers,
and once the roles are closed no kvtransfer thread and no extra native thread.

Every ``TCPStore`` connection makes both ends look up the peer's name (a reverse DNS
query for 127.0.0.1); this machine's resolver drops about one query in 25, and glibc
then waits 5 s, longer than the tests' timeouts. The agents (spawned after this module
is imported) inherit a 1 s resolver timeout; all network activity happens in them.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator

import pytest

from tests.kvtransfer.agent import Agent

os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

AgentsFactory = Callable[[int], list[Agent]]


class AgentPool:
    """Agents reused across tests; dead ones are replaced on the next ``get``."""

    def __init__(self) -> None:
        self.agents: list[Agent] = []
        self.baseline: dict[int, list[str]] = {}  # pid -> OS threads when idle

    def get(self, count: int) -> list[Agent]:
        for i in range(count):
            if i < len(self.agents) and self.agents[i].alive:
                continue
            if i < len(self.agents):
                self.agents[i].kill()
            agent = Agent(f"kvtransfer-agent-{i}")
            self.baseline[agent.pid] = agent.call("warm_up")
            if i < len(self.agents):
                self.agents[i] = agent
            else:
                self.agents.append(agent)
        return self.agents[:count]

    def shutdown(self) -> None:
        for agent in self.agents:
            agent.kill()
        self.agents.clear()


@pytest.fixture(scope="package")
def agent_pool() -> Iterator[AgentPool]:
    pool = AgentPool()
    try:
        yield pool
    finally:
        pool.shutdown()


@pytest.fixture
def agents(agent_pool: AgentPool) -> Iterator[AgentsFactory]:
    """``agents(n)`` -> n live agents with no role; checked for leaks afterwards."""
    used: list[Agent] = []

    def get(count: int) -> list[Agent]:
        got = agent_pool.get(count)
        used[:] = got
        return got

    yield get
    problems = [p for agent in used for p in _check_and_reset(agent, agent_pool)]
    if problems:
        pytest.fail("leak check: " + "; ".join(problems))


def _check_and_reset(agent: Agent, pool: AgentPool) -> list[str]:
    if not agent.alive:
        return []
    try:
        agent.signal(signal.SIGCONT)
        report = agent.call("reset", timeout_s=60)
    except Exception as exc:  # a wedged agent is a failure; replace it
        agent.kill()
        return [f"{agent.proc.name}: reset failed: {exc}"]
    before, after = report["before"], report["after"]
    name = agent.proc.name
    problems = []
    if before.get("open_channels", 0) > before.get("max_channels", 1 << 30):
        problems.append(f"{name}: {before['open_channels']} channels open, bound "
                        f"{before['max_channels']}")
    if before.get("pending", 0):
        problems.append(f"{name}: {before['pending']} transfers pending")
    if after["threads"]:
        problems.append(f"{name}: threads left after close: {after['threads']}")
    baseline = pool.baseline.get(agent.pid, after["native_threads"])
    if len(after["native_threads"]) > len(baseline):
        problems.append(f"{name}: OS threads {after['native_threads']}, {baseline} at start")
    return problems
