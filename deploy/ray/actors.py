"""The bodies of the Ray actors of ``pdserve up --ray`` (plain classes; ``deploy.ray.launcher``
makes them actors with ``ray.remote``).

- ``SupervisedChild`` runs one ``ChildSpec`` (a prefill or decode worker, a router, the
  planner) as a child process on its node, its output appended to ``LOG_DIR/NAME.log``.
- ``RedisActor`` runs a private ``redis-server`` bound to its node's IP, with a generated
  password (other nodes reach it).

Ownership: an actor owns its child, which dies with the actor however the actor dies
(``deploy.children``: in its own session, SIGKILLed by the kernel when the actor's
process goes). One watcher thread per ``SupervisedChild`` waits for the child: when a
``restart`` child exits after it was ready (and no ``stop`` asked for it), the actor exits
(``os._exit``) so that Ray restarts it (``max_restarts``); the new incarnation starts a new
child, which registers again. A child that exits before it was ready does not restart
anything: the actor stays and reports it (``ChildStatus.exit``, with its log's tail), so a
worker that cannot start fails the launch instead of looping. The actors run with
``max_concurrency`` > 1: ``status`` answers while ``stop`` waits for the child.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from deploy.children import describe_exit, log_tail, spawn, terminate
from deploy.ray.plan import ChildSpec, ChildStatus, child_argv, child_env
from deploy.redis_server import RedisServer

_POLL_S = 0.1


class SupervisedChild:
    """Runs ``spec`` on this node until ``stop`` (or until the child or the actor dies)."""

    def __init__(self, spec: ChildSpec) -> None:
        import ray

        self._spec = spec
        self._node_ip = ray.util.get_node_ip_address()
        log_dir = Path(spec.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        self._log_path = log_dir / f"{spec.name}.log"
        self._ready_path = log_dir / f"{spec.name}.ready.json"
        self._ready_path.unlink(missing_ok=True)  # a previous incarnation's
        self._ready: dict[str, Any] | None = None
        self._stopping = False
        self._lock = threading.Lock()
        model = "" if spec.command == "planner" else spec.model_dir or _builtin_model()
        argv = child_argv(spec, node_ip=self._node_ip, model_dir=model,
                          ready_path=str(self._ready_path))
        env = child_env(spec, base=os.environ, node_ip=self._node_ip,
                        gpu_ids=[str(g) for g in ray.get_gpu_ids()])
        with open(self._log_path, "ab") as log:
            log.write(f"--- pdserve: {spec.name} started by Ray actor pid {os.getpid()} on "
                      f"{self._node_ip}\n".encode())
            log.flush()
            self._proc = spawn(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        threading.Thread(target=self._watch, name="pdserve-child-watch", daemon=True).start()

    def status(self) -> ChildStatus:
        self._note_ready()
        code = self._proc.poll()
        return ChildStatus(self._spec.name, os.getpid(), self._node_ip, self._proc.pid,
                           self._ready, None if code is None else describe_exit(code),
                           str(self._log_path), "" if code is None else log_tail(self._log_path))

    def stop(self, grace_s: float) -> str:
        """SIGTERM to the child, SIGKILL (its process group) after ``grace_s``; how it ended."""
        with self._lock:
            self._stopping = True
        terminate(self._proc, grace_s)
        self._ready_path.unlink(missing_ok=True)  # it no longer tells the truth
        return describe_exit(self._proc.returncode)

    def _note_ready(self) -> None:
        with self._lock:
            if self._ready is None and self._ready_path.exists():
                self._ready = json.loads(self._ready_path.read_text())

    def _watch(self) -> None:
        while self._proc.poll() is None:
            self._note_ready()
            time.sleep(_POLL_S)
        self._note_ready()
        with self._lock:
            restart = self._spec.restart and self._ready is not None and not self._stopping
        if restart:
            with open(self._log_path, "ab") as log:
                log.write(f"--- pdserve: {self._spec.name} {describe_exit(self._proc.returncode)}"
                          f"; its actor exits so that Ray restarts it\n".encode())
            os._exit(1)


class RedisActor:
    """A private redis-server on this node's IP, with a generated password."""

    def __init__(self, log_dir: str, stop_grace_s: float) -> None:
        import ray

        self._node_ip = ray.util.get_node_ip_address()
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self._log_path = Path(log_dir) / "redis.log"
        self._server = RedisServer(host=self._node_ip, password=secrets.token_hex(16),
                                   log_path=self._log_path, stop_grace_s=stop_grace_s)
        self._server.start()

    def url(self) -> str:
        """``redis://:PASSWORD@NODE_IP:PORT/0``: a secret; give it to children in their
        environment only."""
        return self._server.url

    def status(self) -> ChildStatus:
        exited = None if self._server.running else "exited"
        return ChildStatus("redis", os.getpid(), self._node_ip, self._server.pid,
                           {"address": f"{self._node_ip}:{self._server.port}"}, exited,
                           str(self._log_path), self._server.log_tail() if exited else "")

    def stop(self, grace_s: float) -> str:
        self._server.stop()
        return "stopped"


def _builtin_model() -> str:
    from engine.testing.tiny_model import ensure_demo_model  # torch: only for this default

    return str(ensure_demo_model())
