"""The ground kvtransfer stands on: an on-demand gloo group (``make_group`` over a
``PrefixStore``/``TCPStore``, no ``init_process_group``) whose surviving side lives
through its peer's SIGKILL and SIGSTOP while the peer is idle, sending or receiving:
it gets an error within the group's timeout, tears the group down without hanging,
and goes on to use a new group. So the transport can stay in the worker's process.

Three processes: the survivor (hosting the store), the victim, and a healthy helper.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import pytest

from engine.tp.distributed import StoreAddress
from tests.kvtransfer.agent import Agent

TIMEOUT_S = 2.0
NBYTES = 4 << 20
SLACK_S = 1.5  # scheduling noise on a shared 2-core machine

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def survivor() -> Iterator[tuple[Agent, StoreAddress]]:
    agent = Agent("spike-survivor")
    try:
        yield agent, agent.call("spike_host", 30.0)
    finally:
        agent.kill()


@pytest.fixture(scope="module")
def helper() -> Iterator[Agent]:
    """A healthy peer for the group built after each failure."""
    agent = Agent("spike-helper")
    try:
        yield agent
    finally:
        agent.kill()


def _pair(survivor: Agent, peer: Agent, address: StoreAddress, prefix: str) -> None:
    survivor.submit("spike_join", address, prefix, 0, TIMEOUT_S)
    peer.call("spike_join", address, prefix, 1, TIMEOUT_S)
    survivor.result(30, "spike_join")


@pytest.mark.parametrize("peer_op", ["idle", "send", "recv"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_survivor_outlives_peer(survivor: tuple[Agent, StoreAddress], helper: Agent, sig: int,
                                peer_op: str) -> None:
    agent, address = survivor
    victim = Agent(f"spike-{sig}-{peer_op}")
    try:
        # 1. a group with the victim; the victim idles, sends or receives in a loop
        _pair(agent, victim, address, f"spike/{int(sig)}/{peer_op}")
        victim.call("spike_start", peer_op, NBYTES)
        agent.submit("spike_until_error", peer_op, NBYTES)
        time.sleep(0.3)
        # 2. the victim dies or hangs; the survivor's operation fails within the timeout
        victim.signal(sig)
        signalled = time.monotonic()
        error, failed_at = agent.result(30, "spike_until_error")
        assert failed_at - signalled < TIMEOUT_S + SLACK_S, (failed_at - signalled, error)
        if sig == signal.SIGKILL and peer_op == "idle":
            # a receive pending when the peer dies fails at once ("connection closed");
            # an operation posted just after (or a send still waiting for the dead peer's
            # "ready to receive") may only fail at the timeout, which is still in bound
            assert "closed" in error.lower() or "reset" in error.lower(), error
        # 3. teardown does not hang
        assert agent.call("spike_abort") < 1.0
        # 4. the survivor still works: a new group with a healthy peer moves bytes
        _pair(agent, helper, address, f"spike/{int(sig)}/{peer_op}/after")
        helper.call("spike_start", "send", 1024)
        assert agent.call("spike_recv_ones", 1024)
        agent.call("spike_abort")
    finally:
        if victim.alive:
            victim.signal(signal.SIGCONT)
        victim.kill()
