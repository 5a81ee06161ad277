"""The router's OpenAI-compatible HTTP edge: the twin of the gRPC edge (``router.service``).

Both edges turn their own messages into a ``router.validation.ClientRequest`` and hand it
to the same ``router.core.RouterCore``, so admission, validation, routing,
cancellation and metrics are shared; this package only speaks HTTP:

- ``protocol``: the request bodies of ``/v1/completions`` and ``/v1/chat/completions``
  (pydantic), the parameters pdserve refuses rather than ignores, and the mapping to a
  ``ClientRequest``;
- ``chat_template``: the model's chat template, rendered as Hugging Face renders it;
- ``responses``: OpenAI's response and stream-chunk shapes built from ``OutputChunk``s;
- ``errors``: status codes and OpenAI's error body (``{"error": {...}}``);
- ``relay``: one request from ``RouterCore.start`` to its last byte, watching for the
  client leaving (which cancels the request on every worker);
- ``app``: the FastAPI application (routes, auth, body limit);
- ``server``: uvicorn on the router's own event loop, on a socket bound at start-up.

Torch-free and protobuf-free (no generated code: ``tests/test_layout.py``).
"""
