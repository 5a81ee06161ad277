"""The cluster-state tests use the private redis-server and leak check of ``tests.pdserve``."""

from tests.pdserve.conftest import no_leaks, raw_redis, redis_server  # noqa: F401
