"""uvicorn serving the HTTP API on the router's own asyncio event loop.

``HttpServer.bind`` binds the listening socket itself (so a taken port fails at start-up,
as the gRPC port does, and port 0 gets a free one) and loads TLS; ``start`` serves on it
from a task of the running loop; ``stop`` stops accepting, gives open requests ``grace_s``
and then cancels them (which cancels their generations on the workers). uvicorn's own
signal handling and logging set-up are left out: the router owns both.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import socket
import ssl
import time
from collections.abc import Callable, Generator

import tokenizers
import uvicorn
from fastapi import FastAPI

from router.config import RouterConfig, TLSFiles
from router.core import RouterCore
from router.http.app import HttpApi, build_app
from router.http.chat_template import ChatTemplateError, load_chat_template

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 10.0


class HttpStartError(RuntimeError):
    """The HTTP API cannot listen (port taken, bad TLS files)."""


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield  # the router handles SIGTERM/SIGINT and calls stop()


class HttpServer:
    """One HTTP listener: ``bind`` → ``start`` → ``stop``."""

    def __init__(self, app: FastAPI, host: str, port: int, *, tls: TLSFiles | None = None,
                 grace_s: float = 5.0) -> None:
        self._config = uvicorn.Config(
            app, host=host, port=port, http="h11", ws="none", lifespan="off",
            log_config=None, access_log=False, server_header=False,
            timeout_graceful_shutdown=max(1, round(grace_s)),
            ssl_certfile=str(tls.cert_file) if tls else None,
            ssl_keyfile=str(tls.key_file) if tls else None)
        self._host, self._port = host, port
        self._socket: socket.socket | None = None
        self._server = _Server(self._config)
        self._task: asyncio.Task[None] | None = None
        self.address: str | None = None

    @property
    def url(self) -> str | None:
        """``http(s)://HOST:PORT`` once bound."""
        if self.address is None:
            return None
        return ("https://" if self._config.is_ssl else "http://") + self.address

    def bind(self) -> str:
        """Loads TLS and binds the socket; returns ``HOST:PORT`` (``HttpStartError``)."""
        try:
            self._config.load()
        except (OSError, ssl.SSLError) as exc:
            raise HttpStartError(f"cannot load the TLS files for the HTTP API: {exc}") from None
        try:
            family = socket.getaddrinfo(self._host, self._port, type=socket.SOCK_STREAM)[0][0]
            sock = socket.create_server((self._host, self._port), family=family)
        except OSError as exc:
            raise HttpStartError(f"cannot listen on {self._host}:{self._port} for HTTP: "
                                 f"{exc.strerror or exc}") from None
        sock.setblocking(False)
        self._socket = sock
        self.address = f"{self._host}:{sock.getsockname()[1]}"
        return self.address

    async def start(self) -> None:
        """Serves on the bound socket; returns once it accepts connections."""
        assert self._socket is not None, "bind() first"
        self._task = asyncio.get_running_loop().create_task(
            self._server.serve(sockets=[self._socket]))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + START_TIMEOUT_S
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise HttpStartError("the HTTP server stopped while starting")
            if loop.time() > deadline:
                raise HttpStartError(f"the HTTP server did not start in {START_TIMEOUT_S}s")
            await asyncio.sleep(0.01)
        logger.info("HTTP API (OpenAI-compatible) on %s", self.url)

    async def stop(self) -> None:
        """Stops accepting, waits up to the grace period for open requests, cancels the
        rest; closes the socket. Idempotent."""
        if self._task is not None:
            self._server.should_exit = True
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def build_http_server(config: RouterConfig, core: RouterCore,
                      tokenizer: tokenizers.Tokenizer, serving: Callable[[], bool]) -> HttpServer:
    """The HTTP API of a router (``config.http`` must be set): its chat template loaded and
    its app built; ``HttpStartError`` for a chat template that cannot be used."""
    assert config.http is not None
    try:
        template = load_chat_template(config.model_dir, config.http.chat_template)
    except ChatTemplateError as exc:
        raise HttpStartError(str(exc)) from None
    if template is None:
        logger.warning("the model has no chat template: /v1/chat/completions answers 400 "
                       "(give one with --chat-template)")
    api = HttpApi(core=core, tokenizer=tokenizer, serving=serving,
                  chat_template=template, api_key=config.api_key,
                  max_body_bytes=config.admission.max_message_bytes, version=_version(),
                  created=int(time.time()))
    return HttpServer(build_app(api), config.host, config.http.port, tls=config.tls,
                      grace_s=config.grace_s)


def _version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
