"""The decode worker (``pdserve decode``): reserves KV blocks, receives a request's KV from
a prefill worker on every tensor-parallel rank, admits it into the running batch and
streams its tokens; it can also prefill locally (colocated mode).

What is the decode kind's own: ``engine_loop`` (``Reserve``/``Open``/``Local`` and each
request's phase), ``kv_leader`` (drives the ranks' receivers), ``kv_rank`` (the receiver
plugin on every rank) and ``server`` (its servicer and ``WorkerKind``). Everything both
kinds share is ``worker/``. May import ``worker``, ``cluster``, ``kvtransfer``, ``engine``;
never ``prefill_worker``.
"""
