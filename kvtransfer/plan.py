"""Which prefill rank sends which KV heads to which decode rank (heterogeneous TP).

Prefill has ``p`` ranks, decode ``r`` ranks, the model ``H`` KV heads; each side holds
heads by the engine's rule (``engine.tp.sharding.kv_head_range``): rank i of t holds
``[i*H/t, (i+1)*H/t)`` when t <= H, else the single head ``floor(i*H/t)`` (replicated).

Decode rank j needs exactly its heads. Each of those heads is taken from one prefill
rank that holds it; when prefill replicates a head over several ranks, decode ranks
are spread over the holders (``holders[j % len(holders)]``) so no one rank sends all.
Consecutive heads from the same prefill rank form one ``Route``.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.tp.sharding import kv_head_range


@dataclass(frozen=True)
class Route:
    """Prefill rank ``sender_rank`` sends global KV heads ``[head_start, head_end)`` to
    decode rank ``receiver_rank``."""

    sender_rank: int
    receiver_rank: int
    head_start: int
    head_end: int

    @property
    def num_heads(self) -> int:
        return self.head_end - self.head_start


def check_tp_size(num_kv_heads: int, tp_size: int) -> None:
    """``ValueError`` unless ``tp_size`` divides ``num_kv_heads`` or the other way round."""
    if tp_size < 1 or (num_kv_heads % tp_size and tp_size % num_kv_heads):
        raise ValueError(
            f"tensor-parallel size {tp_size} and {num_kv_heads} KV heads: one must divide the other"
        )


def plan_routes(num_kv_heads: int, sender_tp: int, receiver_tp: int) -> list[Route]:
    """Every route of a transfer, ordered by receiver rank then head."""
    check_tp_size(num_kv_heads, sender_tp)
    check_tp_size(num_kv_heads, receiver_tp)
    routes: list[Route] = []
    for receiver in range(receiver_tp):
        start, end = kv_head_range(num_kv_heads, receiver, receiver_tp)
        for head in range(start, end):
            holders = [i for i in range(sender_tp) if _holds(num_kv_heads, i, sender_tp, head)]
            sender = holders[receiver % len(holders)]
            last = routes[-1] if routes else None
            if last and last.receiver_rank == receiver and last.sender_rank == sender \
                    and last.head_end == head:
                routes[-1] = Route(sender, receiver, last.head_start, head + 1)
            else:
                routes.append(Route(sender, receiver, head, head + 1))
    return routes


def routes_from(num_kv_heads: int, sender_rank: int, sender_tp: int, receiver_tp: int) -> list[Route]:
    """The routes prefill rank ``sender_rank`` serves."""
    return [r for r in plan_routes(num_kv_heads, sender_tp, receiver_tp) if r.sender_rank == sender_rank]


def local_heads(num_kv_heads: int, rank: int, tp_size: int, head_start: int, head_end: int
                ) -> tuple[int, int]:
    """Global heads ``[head_start, head_end)`` as indices into ``rank``'s local head axis.

    Raises ``ValueError`` when ``rank`` does not hold all of them.
    """
    start, end = kv_head_range(num_kv_heads, rank, tp_size)
    if not start <= head_start < head_end <= end:
        raise ValueError(
            f"rank {rank} of {tp_size} holds KV heads [{start}, {end}), not [{head_start}, {head_end})"
        )
    return head_start - start, head_end - start


def _holds(num_kv_heads: int, rank: int, tp_size: int, head: int) -> bool:
    start, end = kv_head_range(num_kv_heads, rank, tp_size)
    return start <= head < end
