"""What both worker kinds (``prefill_worker``, ``decode_worker``) share.

- ``worker.loop``: the engine-loop thread, its typed commands (``Abort``, ``AbortAll``,
  ``Info`` handled once for both kinds) and the per-request ``OutputStream``;
- ``worker.process``: the engine side of a worker process (build, warm up, ``run_worker``);
- ``worker.server``: the gRPC side (ready file, health, registration after readiness,
  signals and drain), torch-free;
- ``worker.servicer``: the protobuf edge shared by both servicers (``Abort``, ``Info``);
- ``worker.rank_calls``: the vocabulary of the leader's calls to its ranks' KV plugins
  (transfer statuses, aborts, per-rank stats);
- ``worker.options``: the command-line options (standard library only);
- ``worker.leases``: the attempts' leases a worker watches, and the watcher that frees an
  attempt whose lease is gone.

May import: ``cluster``, ``kvtransfer``, ``engine``; never ``prefill_worker``,
``decode_worker``, the router or the SDK.
"""
