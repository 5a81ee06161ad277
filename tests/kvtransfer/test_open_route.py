"""``kvtransfer.send.open_route``: a lane's kept store connection that broke at once is
tried again over a new one when the address accepts connections (a decode worker
restarted there: tests/kvtransfer/test_faults.py runs that through real processes); one
that failed only after a while (a hung peer: its address still accepts connections) is
not, so the failure takes one timeout, not two. The store and the probe are stand-ins."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from kvtransfer.errors import ChannelError
from kvtransfer.send import open_route as route
from kvtransfer.wire.protocol import OpenRequest
from tests.kvtransfer.topology import CONFIG, LAYOUT

ADDRESS = route.StoreAddress("127.0.0.1", 1)


class BrokenStore:
    """A kept connection whose every call fails after ``delay_s``."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def add(self, key: str, value: int) -> int:
        time.sleep(self.delay_s)
        raise dist.DistNetworkError("Broken pipe" if not self.delay_s else "Socket Timeout")


@pytest.mark.parametrize(("delay_s", "retried"), [(0.0, True), (0.6, False)],
                         ids=["broke-at-once", "hung"])
def test_only_a_connection_that_broke_at_once_is_tried_again(
        monkeypatch: pytest.MonkeyPatch, delay_s: float, retried: bool) -> None:
    connects: list[Any] = []

    def connect_store(address: Any, timeout_s: float) -> BrokenStore:
        connects.append(address)
        return BrokenStore(0.0)

    monkeypatch.setattr(route, "connect_store", connect_store)
    monkeypatch.setattr(route, "_listening", lambda dest: True)  # it accepts connections
    request = OpenRequest(0, "sender", 0, 1, 0, "gloo", LAYOUT)
    with pytest.raises(ChannelError):
        route.open_route(BrokenStore(delay_s), ADDRESS, request, torch.device("cpu"),
                         dataclasses.replace(CONFIG, timeout_s=1.0))
    assert connects == ([ADDRESS] if retried else [])
