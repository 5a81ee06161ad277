"""A rank plugin for tests: reads this rank's KV blocks and counts layer hooks.

Requests: ``b"stats"`` → (rank, layers seen) as two int64 + the last step payload;
``b"read:" + int64 block ids`` → layer 0's K for those blocks as float32 bytes;
``b"kernels"`` → this rank's linear kernel plan as ``out,in,kernel;...`` (then ``|source``);
``b"fail"`` → raises.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence

from engine.attention.metadata import LayerHook
from engine.core.scheduler import ScheduledChunk
from engine.tp.rank_plugin import RankContext


class ProbePlugin:
    def __init__(self, ctx: RankContext) -> None:
        self.ctx = ctx
        self.layers_seen = 0
        self.last_payload = b""

    def handle(self, request: bytes) -> bytes:
        op, _, rest = request.partition(b":")
        if op == b"stats":
            return struct.pack("<qq", self.ctx.rank, self.layers_seen) + self.last_payload
        if op == b"read":
            block_ids = array("q")
            block_ids.frombytes(rest)
            return self.ctx.kv_cache[0, 0, list(block_ids)].contiguous().numpy().tobytes()
        if op == b"kernels":
            plan = self.ctx.kernel_plan
            assert plan is not None
            return (";".join(f"{o},{i},{k}" for o, i, k in plan.kernels)
                    + f"|{plan.source}").encode()
        raise ValueError(f"asked to {op.decode()}")

    def step_hook(self, chunks: Sequence[ScheduledChunk], payload: bytes) -> LayerHook | None:
        self.last_payload = payload

        def count(layer_idx: int) -> None:
            self.layers_seen += 1

        return count

    def close(self) -> None:
        pass


def make(ctx: RankContext) -> ProbePlugin:
    return ProbePlugin(ctx)
