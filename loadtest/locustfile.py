"""Locust users of a pdserve cluster: ``GrpcStreamUser`` (the streaming gRPC API through
``pdserve.Client``) and ``OpenAIStreamUser`` (the OpenAI-compatible ``/v1/completions``
with server-sent events).

    locust -f loadtest/locustfile.py --headless -u 50 -r 10 -t 1m --host grpc://127.0.0.1:50051
    locust -f loadtest/locustfile.py OpenAIStreamUser --host http://127.0.0.1:8000 ...

Run it from the repository root. With no user class named, the ``--host`` scheme picks one
(``grpc://``: gRPC, ``http(s)://``: HTTP). Every request is reported as three locust
request entries, named by the workload: request type ``TTFT`` (time to its first token),
``TPOT`` (``(e2e − ttft) / (tokens − 1)``, requests with two or more tokens) and ``E2E``
(to its last token); a failed request is one failed ``E2E`` entry whose message starts
with its status (the gRPC status name, or ``HTTP 429``). Each user sends its requests back
to back (closed loop; ``--think-time`` seconds between them).

Workloads (``loadtest.workloads``; option or environment variable):
``--workload fixed|shared-prefix|sharegpt-like`` (``PDSERVE_WORKLOAD``, default fixed);
fixed: ``--input-len`` / ``--output-len`` (``PDSERVE_INPUT_LEN`` 128,
``PDSERVE_OUTPUT_LEN`` 32); shared-prefix: ``--num-prefixes`` groups sharing
``--prefix-len`` tokens, each request adding ``--input-len`` of its own; sharegpt-like:
synthetic log-normal lengths. ``--vocab-size`` (``PDSERVE_VOCAB_SIZE``; default: asked of
the router over gRPC, else 700, below the built-in tiny model's vocabulary).

gevent: locust patches the standard library; gRPC's own gevent support is switched on
here (``grpc.experimental.gevent.init_gevent``) before any channel exists, so a blocking
``pdserve.Client`` stream yields to the other users.
"""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import urlsplit

import grpc.experimental.gevent as grpc_gevent
from locust import User, events, task
from locust.env import Environment

from loadtest.workloads import Request, Workload, WorkloadSpec

grpc_gevent.init_gevent()  # before any gRPC channel is made

import pdserve  # noqa: E402  (after init_gevent)

WORKLOAD_NAMES = {"fixed": "random", "shared-prefix": "prefix-repetition",
                  "sharegpt-like": "sharegpt-like"}
DEFAULT_VOCAB = 700
TIMEOUT_S = 600.0


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    group = parser.add_argument_group("pdserve")
    group.add_argument("--workload", choices=sorted(WORKLOAD_NAMES), default="fixed",
                       env_var="PDSERVE_WORKLOAD", help="what each request looks like")
    for flag, env, default, text in (
            ("--input-len", "PDSERVE_INPUT_LEN", 128, "prompt tokens (shared-prefix: own part)"),
            ("--output-len", "PDSERVE_OUTPUT_LEN", 32, "tokens generated per request"),
            ("--prefix-len", "PDSERVE_PREFIX_LEN", 256, "shared-prefix: tokens shared"),
            ("--num-prefixes", "PDSERVE_NUM_PREFIXES", 8, "shared-prefix: groups"),
            ("--vocab-size", "PDSERVE_VOCAB_SIZE", 0, "token ids below this (0: ask)")):
        group.add_argument(flag, type=int, default=default, env_var=env, help=text)
    group.add_argument("--think-time", type=float, default=0.0, env_var="PDSERVE_THINK_TIME",
                       help="seconds each user waits between its requests")
    group.add_argument("--api-key", default="", env_var="PDSERVE_API_KEY")


@events.init.add_listener
def _pick_user_class(environment: Environment, **_kwargs: Any) -> None:
    """With both classes running (none named), keep the one the host's scheme speaks."""
    classes = environment.user_classes
    if len(classes) > 1 and environment.host:
        scheme = urlsplit(environment.host).scheme
        keep = [c for c in classes if scheme in getattr(c, "schemes", ())]
        if keep:
            classes[:] = keep


class _Workload:
    """One workload per process, shared by its users (one seeded generator)."""

    workload: Workload | None = None

    @classmethod
    def next(cls, environment: Environment, vocab_size: int) -> Request:
        if cls.workload is None:
            o = environment.parsed_options
            assert o is not None  # run by locust's command line
            spec = WorkloadSpec(WORKLOAD_NAMES[o.workload], input_len=o.input_len,
                                output_len=o.output_len, prefix_len=o.prefix_len,
                                suffix_len=o.input_len, num_prefixes=o.num_prefixes)
            cls.workload = Workload(spec, vocab_size, seed=int(time.time()))
        return cls.workload.next()


class _StreamUser(User):
    abstract = True
    schemes: tuple[str, ...] = ()

    def wait_time(self) -> float:
        return float(self.options.think_time)

    def on_start(self) -> None:
        self.options = self.environment.parsed_options
        self.entry = self.options.workload  # the name of its locust entries

    def report(self, ttft_s: float, e2e_s: float, num_tokens: int) -> None:
        fire = self.environment.events.request.fire
        fire(request_type="TTFT", name=self.entry, response_time=ttft_s * 1000,
             response_length=num_tokens, exception=None, context={})
        if num_tokens > 1:
            fire(request_type="TPOT", name=self.entry,
                 response_time=(e2e_s - ttft_s) / (num_tokens - 1) * 1000,
                 response_length=num_tokens, exception=None, context={})
        fire(request_type="E2E", name=self.entry, response_time=e2e_s * 1000,
             response_length=num_tokens, exception=None, context={})

    def failed(self, started: float, message: str) -> None:
        self.environment.events.request.fire(
            request_type="E2E", name=self.entry, response_time=(time.perf_counter() - started)
            * 1000, response_length=0, exception=RequestFailed(message), context={})


class RequestFailed(Exception):
    """A request that did not complete; the message starts with its status."""


class GrpcStreamUser(_StreamUser):
    """Streams completions over the public gRPC API (``--host grpc://HOST:PORT``, or
    ``grpc://HOST:PORT,HOST:PORT,...`` for several routers: the SDK spreads the calls over
    them and resumes a broken stream on the next one)."""

    schemes = ("grpc",)

    def on_start(self) -> None:
        super().on_start()
        parts = urlsplit(self.host or "")
        if parts.scheme != "grpc" or not parts.netloc:
            raise ValueError(f"GrpcStreamUser needs --host grpc://HOST:PORT, got {self.host!r}")
        self.client = pdserve.Client(parts.netloc.split(","),
                                     api_key=self.options.api_key or None)
        self.vocab_size = self.options.vocab_size or self.client.model_info(
            timeout=30).vocab_size

    def on_stop(self) -> None:
        self.client.close()

    @task
    def generate(self) -> None:
        request = _Workload.next(self.environment, self.vocab_size)
        started = time.perf_counter()
        first, num_tokens = None, 0
        try:
            for chunk in self.client.generate(prompt_token_ids=request.prompt_token_ids,
                                              max_tokens=request.max_tokens, temperature=0.0,
                                              ignore_eos=True, timeout=TIMEOUT_S):
                if chunk.token_ids and first is None:
                    first = time.perf_counter()
                num_tokens += len(chunk.token_ids)
        except pdserve.PdserveError as exc:
            self.failed(started, f"{exc.code.name}: {exc.details}")
            return
        if first is None:
            self.failed(started, "OK but no token")
            return
        self.report(first - started, time.perf_counter() - started, num_tokens)


class OpenAIStreamUser(_StreamUser):
    """Streams ``/v1/completions`` over the OpenAI-compatible HTTP API (``--host
    http://HOST:PORT``); the first token is the first chunk with text."""

    schemes = ("http", "https")

    def on_start(self) -> None:
        super().on_start()
        import requests  # patched by locust's gevent: cooperative

        parts = urlsplit(self.host or "")
        if parts.scheme not in self.schemes or not parts.netloc:
            raise ValueError(f"OpenAIStreamUser needs --host http://HOST:PORT, got {self.host!r}")
        self.url = f"{parts.scheme}://{parts.netloc}/v1/completions"
        self.session = requests.Session()
        if self.options.api_key:
            self.session.headers["Authorization"] = f"Bearer {self.options.api_key}"
        self.vocab_size = self.options.vocab_size or DEFAULT_VOCAB

    def on_stop(self) -> None:
        self.session.close()

    @task
    def complete(self) -> None:
        request = _Workload.next(self.environment, self.vocab_size)
        body: dict[str, Any] = {"prompt": list(request.prompt_token_ids), "max_tokens": request.max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        started = time.perf_counter()
        try:
            with self.session.post(self.url, json=body, stream=True,
                                   timeout=TIMEOUT_S) as response:
                if response.status_code != 200:
                    self.failed(started, f"HTTP {response.status_code}: {response.text[:200]}")
                    return
                # bytes: split at line ends only (decoded text would also split at U+2028
                # and the like, which the JSON of generated text carries unescaped)
                first, usage, error = self._read(
                    line.decode("utf-8") for line in response.iter_lines())
        except OSError as exc:  # requests' errors are OSErrors
            self.failed(started, f"{type(exc).__name__}: {exc}")
            return
        if error is not None or first is None or usage is None:
            self.failed(started, error or "the stream ended without text or usage")
            return
        self.report(first - started, time.perf_counter() - started,
                    int(usage["completion_tokens"]))

    @staticmethod
    def _read(lines: Any) -> tuple[float | None, dict[str, Any] | None, str | None]:
        """(when the first text came, the usage, an error message) of an SSE stream."""
        first = usage = None
        for line in lines:
            if not line or not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                return first, usage, f"stream error: {event['error'].get('message', '')}"
            if first is None and event.get("choices") and event["choices"][0].get("text"):
                first = time.perf_counter()
            usage = event.get("usage") or usage
        return first, usage, None
