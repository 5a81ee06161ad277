"""``pdserve.v1``: the public API the router serves, from ``proto/pdserve/v1``.

``generate_pb2`` (messages) and ``generate_pb2_grpc`` (the ``Generation`` stub and
servicer) are generated and committed: edit the ``.proto`` and run
``python -m tools.protogen``, never edit them by hand. Most users want the SDK instead:
``pdserve.Client`` / ``pdserve.AsyncClient``.
"""
