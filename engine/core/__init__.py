"""The engine's step-level core: a request's state (``request``, torch-free), the scheduler
(``scheduler``, torch-free: continuous batching, chunked prefill, preemption, prefix
caching over block ids and counts), the model runner that turns a step into tensors
(``runner``), the sampler (``sampler``) and ``EngineCore`` (``engine_core``), which the
workers and ``engine.LLM`` drive one ``step()`` at a time.

Importing this package loads nothing: the torch-free modules stay torch-free.
"""
