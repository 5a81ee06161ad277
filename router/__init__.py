"""The router: pdserve's public front door (``pdserve router``). Torch-free.

It validates and tokenizes client requests (``validation``), admits them within the
in-flight and queued-token budgets (``admission``; ``core`` is the one core both
front ends call), picks a prefill worker by prefix affinity and a decode worker by load
(``routing``) from the workers registered in Redis (``workers``), drives each request's
lifecycle (``handoff``) through the workers' internal API (``worker_calls``, the adapter)
and relays the token stream: ``service`` holds the ``pdserve.v1`` gRPC handlers (``api``
parses their messages), ``http`` the OpenAI-compatible HTTP API, ``server`` the process,
``metrics`` its Prometheus series.

May import ``cluster``, the torch-free parts of ``engine``, ``engine.kvcache.layout`` and the
public generated code ``pdserve.v1``; never the workers or the SDK's client modules.
"""
