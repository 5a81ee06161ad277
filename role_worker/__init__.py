"""The worker program that serves either role and switches between them live
(``pdserve worker --role prefill|decode``; ``pdserve prefill`` and ``pdserve decode`` are
its two spellings).

The model and the KV pool do not depend on the role, so one process holds both kinds'
engine loops in one (``engine_loop.WorkerLoop``) and both kinds' gRPC services on one
server (``server``). ``SetRole`` over the internal API changes which role it takes new
work for; what it holds of the old role finishes in place. May import
``prefill_worker``, ``decode_worker``, ``worker``, ``cluster``, ``kvtransfer``, ``engine``.
"""
