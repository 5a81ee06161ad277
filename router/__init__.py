"""The router: pdserve's public front door (``pdserve router``). Torch-free.

It validates and tokenizes client requests, picks a prefill worker by prefix affinity and
a decode worker by load from the workers registered in Redis, drives each request's
handoff over the internal worker API and relays the token stream (``pdserve.v1``).
"""
