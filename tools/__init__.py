"""Development tools of the pdserve repository; not shipped in the wheel.

- ``python -m tools.protogen``: regenerate the committed protobuf/gRPC modules from ``proto/``.
"""
