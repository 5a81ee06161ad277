"""``cluster.internal.v1``: router ↔ worker control API, from ``proto/cluster/internal/v1``
(protobuf package ``pdserve.internal.v1``: the service names on the wire).

``worker_pb2`` (messages), ``worker_pb2_grpc`` (``DecodeWorker`` and ``PrefillWorker``
stubs and servicers) are generated and committed: edit the ``.proto`` and run
``python -m tools.protogen``, never edit them by hand. The ``.proto`` states each RPC's
contract (who frees what on error, idempotency, deadlines).
"""
