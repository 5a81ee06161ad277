"""The Prefill sent together with its Reserve, not after the Reserve's reply (the rooms:
``router.lifecycle``; ``Placement`` decides, ``Attempt.send_ahead`` sends).

It goes ahead when the router can name the target itself (``ahead_target``): the decode
worker's registered KV address, and no blocks to skip — routing kv-aware, where a trusted
index says the worker holds none of the prompt (the Reserve, ``expected_cached_blocks``
0, then reuses none, which it always can). A worker holding a prefix is asked first: its
reply says which blocks the sender skips; so is one whose KV for a prompt with the same
first block this router saw land there in the last seconds (``router.recent_kv``: the
index may not list those blocks yet). And only where the Reserve should succeed: the
worker's registered free blocks hold the request.

``AheadGate`` (one per router) keeps it from costing the prefill workers while a decode
worker is full: one that refused a Reserve for want of room (its free blocks as the router
saw them were stale, or it is at its request limit; or it is draining, or serves the
other role now) gets no Prefill ahead of its replies until it accepts a Reserve again, or
for ``REFUSAL_MEMORY_S`` (then a worker still full refuses one more; one that left the
cluster is forgotten, so the gate holds only recent refusals). A refused Reserve aborts the Prefill that went with it
(and the decode worker refuses its transfer id, as it does when such a Reserve's call
fails or is cancelled, so KV already on its way is dropped; the Prefill's own failure
then blames no worker), and that request's later Reserves wait for their reply.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from cluster.kv_target import KVTarget
from engine.tp.sharding import num_blocks_for
from router.inflight_kv import InFlightKV
from router.lifecycle.attempt import Attempt
from router.recent_kv import RecentKV

REFUSAL_MEMORY_S = 60.0  # how long a refusal for want of room keeps Prefills from going ahead


class AheadGate:
    """Which decode workers get a Prefill ahead of their Reserve's reply (see the module
    docstring); fed every Reserve's outcome and where KV landed (``recent``)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # decode worker -> when it refused for want of room (not accepted since)
        self._refusing: dict[str, float] = {}
        self.recent = RecentKV(clock)
        self.in_flight = InFlightKV()  # prompts on their way (``router.lifecycle.coalesce``)

    def allows(self, decode_id: str, block_hashes: Sequence[bytes] = ()) -> bool:
        """Whether a prompt with these full-block hashes may go ahead to ``decode_id``."""
        refused = self._refusing.get(decode_id)
        if refused is not None and self._clock() - refused <= REFUSAL_MEMORY_S:
            return False
        return not self.recent.may_hold(decode_id, block_hashes)

    def reserve_answered(self, decode_id: str, *, reserved: bool,
                         for_want_of_room: bool) -> None:
        """A Reserve on ``decode_id`` was answered (the simulator calls this directly)."""
        if reserved:
            self._refusing.pop(decode_id, None)
        elif for_want_of_room:
            now = self._clock()
            for worker_id in [w for w, t in self._refusing.items() if now - t > REFUSAL_MEMORY_S]:
                del self._refusing[worker_id]
            self._refusing[decode_id] = now

    @property
    def num_refusals(self) -> int:
        """Refusals remembered (expired ones go with the next refusal). Not ``__len__``: an
        empty gate must not be falsy (``gate or AheadGate()`` would replace it)."""
        return len(self._refusing)

    def answered(self, attempt: Attempt, refusal: tuple[str, bool] | None) -> bool:
        """The outcome of ``attempt``'s Reserve (None: reserved; else why not, and whether
        for want of room); whether it was refused with its Prefill sent ahead (its request
        sends none ahead from then on)."""
        self.reserve_answered(attempt.decode_id, reserved=refusal is None,
                              for_want_of_room=refusal is not None and refusal[1])
        if refusal is None or attempt.ahead is None:
            return False
        attempt.ctx.log.info("attempt %s: %s did not reserve (%s); its Prefill, sent ahead, is "
                             "aborted", attempt.id, attempt.decode_id, refusal[0])
        return True


def ahead_target(attempt: Attempt, gate: AheadGate, held_blocks: int,
                 block_hashes: Sequence[bytes] = ()) -> KVTarget | None:
    """The target a Prefill sent ahead of ``attempt``'s Reserve names, or None (it waits
    for the reply): ``held_blocks``, the prompt's leading blocks the decode worker holds by
    a trusted index, must be 0, the gate must allow it (``block_hashes``: the prompt's, as
    the worker would key them), its registered free blocks hold the prompt (what a Reserve
    takes: not its ``max_tokens``, which a chat request without one sets to the whole
    context), and no planned move be pending (its Prefill goes to the draining worker)."""
    ctx = attempt.ctx
    if held_blocks or ctx.pending_move is not None \
            or not gate.allows(attempt.decode_id, block_hashes):
        return None
    record = next((r for r in ctx.pool.routable("decode") if r.worker_id == attempt.decode_id),
                  None)
    if record is None or not record.kv_address \
            or record.free_kv_blocks < num_blocks_for(len(ctx.request.prompt_token_ids),
                                                      ctx.block_size):
        return None
    return KVTarget(attempt.transfer_id, record.kv_address, record.tensor_parallel_size, 0)
