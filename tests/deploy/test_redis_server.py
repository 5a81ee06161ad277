"""The private redis-server: loopback only, memory only, restartable, and dies with its owner."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

import deploy.redis_server as redis_server_module
from deploy.redis_server import RedisServer, RedisServerError
from tests.processes import alive, children, wait_until

pytestmark = pytest.mark.timeout(30)


def client_of(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)


def test_serves_on_loopback_in_memory_only(redis_server: RedisServer,
                                           raw_redis: redis.Redis) -> None:
    assert redis_server.url == f"redis://127.0.0.1:{redis_server.port}/0"
    assert raw_redis.ping()
    assert raw_redis.config_get("bind") == {"bind": "127.0.0.1"}
    assert raw_redis.config_get("save") == {"save": ""}
    assert raw_redis.config_get("appendonly") == {"appendonly": "no"}
    assert int(raw_redis.info("server")["process_id"]) == redis_server.pid


def test_stop_is_idempotent_and_reaps_the_process() -> None:
    server = RedisServer().start()
    pid = server.pid
    assert pid is not None and alive(pid)
    server.stop()
    server.stop()
    assert not alive(pid) and pid not in children(os.getpid())
    assert not server.running and server.pid is None


def test_restart_keeps_the_port_and_loses_the_data(redis_server: RedisServer) -> None:
    url, old_pid = redis_server.url, redis_server.pid
    client = client_of(url)
    client.set("k", "v")
    redis_server.restart()
    assert redis_server.url == url and redis_server.pid != old_pid
    assert client.get("k") is None  # the client reconnects; the data is gone
    client.close()


def test_password_is_required_and_kept_off_the_command_line() -> None:
    password = 'se cr"et/@:'
    with RedisServer(password=password) as server:
        assert password not in repr(server)
        with open(f"/proc/{server.pid}/cmdline", "rb") as f:
            assert password.encode() not in f.read()
        assert client_of(server.url).ping()  # the URL carries the (quoted) password
        anonymous = client_of(f"redis://127.0.0.1:{server.port}/0")
        with pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        anonymous.close()


def test_a_port_taken_meanwhile_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.create_server(("127.0.0.1", 0)) as squatter:
        taken = squatter.getsockname()[1]
        picks = iter([taken])
        real_free_port = redis_server_module._free_port
        monkeypatch.setattr(redis_server_module, "_free_port",
                            lambda host: next(picks, None) or real_free_port(host))
        with RedisServer() as server:
            assert server.port != taken and client_of(server.url).ping()


def test_it_binds_the_host_it_is_given() -> None:
    # 127.0.0.2 is loopback too, but not 127.0.0.1: only the given address answers
    with RedisServer(host="127.0.0.2", password="secret") as server:
        assert server.url == f"redis://:secret@127.0.0.2:{server.port}/0"
        assert client_of(server.url).ping()
        with pytest.raises(redis.ConnectionError):
            client_of(f"redis://:secret@127.0.0.1:{server.port}/0").ping()


def test_an_explicit_taken_port_fails_at_once() -> None:
    with socket.create_server(("127.0.0.1", 0)) as squatter:
        taken = squatter.getsockname()[1]
        with pytest.raises(RedisServerError, match=f"port {taken} already in use"):
            RedisServer(port=taken).start()


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "fake-redis-server"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def test_a_failed_start_reports_the_server_output(tmp_path: Path) -> None:
    fake = _script(tmp_path, "echo 'FATAL: bad config line' >&2; exit 3")
    with pytest.raises(RedisServerError, match=r"(?s)exited with code 3.*bad config line"):
        RedisServer(executable=fake).start()


def test_a_start_timeout_reports_the_output_and_kills_the_server(tmp_path: Path) -> None:
    fake = _script(tmp_path, "echo 'still thinking'; exec sleep 30")
    server = RedisServer(executable=fake, start_timeout_s=0.5, stop_grace_s=0.5)
    with pytest.raises(RedisServerError, match=r"(?s)did not answer PING within 0.5s.*thinking"):
        server.start()
    assert server.pid is None  # killed and reaped; the leak check confirms


def test_the_server_outlives_the_thread_that_started_it() -> None:
    # PR_SET_PDEATHSIG follows the forking *thread*; spawning must not tie the server to it.
    holder: list[RedisServer] = []
    thread = threading.Thread(target=lambda: holder.append(RedisServer().start()))
    thread.start()
    thread.join(15)
    server = holder[0]
    try:
        time.sleep(0.5)  # the spawning thread is gone: the server must outlive it
        assert server.running
        assert client_of(server.url).ping()
    finally:
        server.stop()


_OWNER = """
import sys, time
from deploy.redis_server import RedisServer
server = RedisServer().start()
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(server.pid))
import os; os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(60)
"""


def test_the_server_dies_when_its_owner_is_sigkilled(tmp_path: Path) -> None:
    pid_file = tmp_path / "redis.pid"
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, str(pid_file)],
                             cwd=Path(__file__).parents[2])
    try:
        wait_until(pid_file.exists, 20, "the owner never started its redis-server")
        redis_pid = int(pid_file.read_text())
        assert alive(redis_pid)
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(10)
        wait_until(lambda: not alive(redis_pid), 5, "redis-server survived")
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(10)
