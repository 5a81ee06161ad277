"""The router's request lifecycle — the handoff — one job per room.

DESIGN.md's request lifecycle, for one validated, admitted request:

1. Reserve KV blocks on a decode worker (least busy first; a refusal moves on to the next
   worker; all refusing → wait for capacity; none reachable → UNAVAILABLE) —
   ``placement``;
2. Prefill on a prefill worker in rendezvous order of the prompt's affinity key (bounded
   load; or in turn, with ``prefill_routing`` "round-robin"), naming the reservation's KV
   target; it pushes the KV and the first token — ``prefill``;
3. Generate on the decode worker, opened together with the Prefill, and relay its chunks:
   the first leaves once the KV (with the first token) has arrived there, without
   waiting for the Prefill's reply; until that first chunk a failed Prefill fails the
   attempt — ``relay``.

With ``local_prefill`` "always" (colocated mode), or "fallback" once no prefill worker is
left for the request, an attempt is one ``GenerateLocal`` on the decode worker instead.

The rooms:

- ``handoff``: ``Handoff``, the retry loop — places an attempt (the first one waits its
  turn in the router's queue), runs it, and on a failure before the first token aborts it
  and tries again elsewhere, up to ``max_attempts``; any failure it does not expect ends
  the request with INTERNAL, everything released;
- ``attempt``: ``Attempt``, one try at serving the request on workers, with its own id
  (minted by ``AttemptIds``, the one place ids come from), its lease, its calls and its
  aborts, in explicit states; ``end()`` releases everything, once;
- ``placement``: choosing workers and reserving (decode reservation, local attempts,
  prefill order);
- ``prefill``: the Prefill call on the chosen prefill workers, and its verdict;
- ``relay``: the decode worker's stream, and the race of its first chunk with the Prefill;
- ``context``: what every room of one request reads (the request, its deadline, the
  workers it excluded, the one reading of a failed call) — ``RequestContext``;
- ``outcomes``: how an attempt ends short of the client's error (``Retry``, ``Busy``).

The calls themselves (protobuf, stubs) are ``router.worker_calls``'.
"""
