"""The prefill worker (``pdserve prefill``): prefills prompts in continuous batches and
pushes each one's KV, layer by layer, to the decode worker that reserved it.

What is the prefill kind's own: ``engine_loop`` (the ``Submit`` command and the life of a
prefill), ``kv_leader`` (drives the ranks' senders), ``kv_rank`` (the sender plugin on every
rank) and ``server`` (its servicer and ``WorkerKind``). Everything both kinds share is
``worker/``. May import ``worker``, ``cluster``, ``kvtransfer``, ``engine``; never
``decode_worker``.
"""
