"""Cluster state shared by the router and the workers (torch-free).

- ``cluster.records``: the JSON records kept in Redis (``WorkerRecord``, the fingerprint);
- ``cluster.registry``: the ``Registry`` client of Redis (keys, errors, registration);
- ``cluster.heartbeat``: a worker's heartbeat keeping its record alive;
- ``cluster.view``: the router's last-known-good view of the live workers;
- ``cluster.fingerprint``: the model fingerprint of a checkpoint directory;
- ``cluster.leases``: the router-owned lease of each attempt (keys, store, the router's keeper);
- ``cluster.pause_points``: test-only pause points and event records (router and workers);
- ``cluster.clock``: the injectable clock of leases, TTLs and heartbeats;
- ``cluster.logs`` (log format of every process), ``cluster.files`` (atomic JSON files);
- ``cluster.internal.v1``: the router ↔ worker gRPC API's generated code.

May import: ``engine.kvcache.layout`` (the KV layout a fingerprint is part of) and third-party
libraries (redis, xxhash, grpc); never torch, the engine's runtime, the workers or the router.
"""
