"""Internal wire APIs between pdserve processes (router ↔ workers); not for clients.

Versioned subpackages (``v1``) hold protobuf/gRPC modules generated from ``proto/`` by
``python -m tools.protogen``. Only thin gRPC adapter modules import them.
"""
