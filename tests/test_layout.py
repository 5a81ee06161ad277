"""Every layout rule of the tree, in one place (DESIGN.md "Import rules"; the
architecture page of the docs): who may import whom, what loads torch, and how large a
file or a class may grow.

The graph is read statically (``ast``) from every non-test, non-generated module, with
every import at any depth — module level, inside functions, under ``TYPE_CHECKING`` — so a
function-level import cannot hide a cycle or a forbidden edge. Runtime checks then import
the torch-free packages in an interpreter where ``import torch`` fails.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterable
from functools import cache
from pathlib import Path

import pytest

from tests.factories import REPO_ROOT, run_without_torch

PACKAGES = ("engine", "kvtransfer", "cluster", "worker", "prefill_worker", "decode_worker",
            "role_worker", "router", "deploy", "pdserve", "sim", "planner", "tools", "bench",
            "loadtest")
TORCH = ("torch", "flash_attn", "triton")

# What each package may import from the tree (besides itself). Imports point down:
# pdserve (SDK, CLI) -> deploy -> router, role_worker -> prefill_worker, decode_worker ->
# worker -> cluster, kvtransfer, engine. deploy reaches the servers through their option modules only.
MAY_IMPORT = {
    "engine": set(),
    "kvtransfer": {"engine"},
    # the KV layout a fingerprint is part of, the KV event operations the stream carries
    "cluster": {"engine.kvcache.layout", "engine.kvcache.events"},
    "worker": {"cluster", "kvtransfer", "engine"},
    "prefill_worker": {"worker", "cluster", "kvtransfer", "engine"},
    "decode_worker": {"worker", "cluster", "kvtransfer", "engine"},
    # the worker program that serves either role: both kinds' loops and services in one
    "role_worker": {"prefill_worker", "decode_worker", "worker", "cluster", "kvtransfer", "engine"},
    "router": {"cluster", "engine", "pdserve.v1"},
    # ... and the cluster's state in Redis where a launcher acts on it (the planner's
    # scale steps: deploy.ray.scaling)
    "deploy": {"router.options", "worker.options", "engine.testing.tiny_model",
               "cluster.scale", "cluster.registry", "cluster.records"},
    # the simulator runs the router's and the engine's real decision code, on the
    # workloads bench.serve draws
    "sim": {"router", "cluster", "engine", "planner", "loadtest.workloads"},
    # the planner's policy is I/O-free; what it acts through is the cluster's
    "planner": {"cluster"},
}
SDK_MODULES = ("pdserve", "pdserve.client", "pdserve.aio_client", "pdserve.failover",
               "pdserve.results", "pdserve.v1")
# The thin gRPC adapters: the only modules that import generated protobuf code.
ADAPTERS = {
    "pdserve.client", "pdserve.aio_client", "pdserve.failover",  # the SDK
    "router.api", "router.service", "router.worker_calls",  # the router's two edges
    "router.debug",  # the router's introspection service
    "worker.servicer", "prefill_worker.server", "decode_worker.server",  # the workers' edge
    "role_worker.server",
    "cluster.worker_control",  # SetRole, for operators (pdserve set-role) and the planner
}
GENERATED = ("pdserve.v1.generate_pb2", "pdserve.v1.generate_pb2_grpc",
             "cluster.internal.v1.worker_pb2", "cluster.internal.v1.worker_pb2_grpc")
# Modules that must never load torch (statically, through everything they import).
TORCH_FREE = ("engine.kvcache", "engine.core.scheduler", "engine.core.request", "engine.config",
              "engine.sampling_params", "engine.grammar", "engine.tp.sharding", "engine.text.tokenizer",
              "engine.kvcache.layout", "kvtransfer.wire.protocol", "kvtransfer.config",
              "kvtransfer.states", "kvtransfer.plan", "cluster", "router", "worker.server",
              "worker.loop", "worker.options", "cluster.pause_points", "pdserve.cli", "deploy", "sim", "planner",
              *SDK_MODULES)


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    """Every non-test, non-generated module of the tree, by name."""
    found = {}
    for package in PACKAGES:
        for path in (REPO_ROOT / package).rglob("*.py"):
            if "_pb2" not in path.name:
                found[_module_name(path)] = path
    return found


def _import_time_nodes(tree: ast.AST) -> Iterable[ast.AST]:
    """The nodes that run when the module is imported: not function bodies, not
    ``if TYPE_CHECKING:`` blocks."""
    todo = list(ast.iter_child_nodes(tree))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        yield node
        todo.extend(ast.iter_child_nodes(node))


def imported_names(path: Path, package: str, *, import_time: bool = False) -> set[str]:
    """Absolute names of every module ``path`` imports, at any depth (with
    ``import_time``: only those imported when the module itself is); ``package`` is the
    module's package (for relative imports)."""
    names: set[str] = set()
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in _import_time_nodes(tree) if import_time else ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _resolve(name: str) -> str | None:
    """The tree module ``name`` refers to (a module, or the package of a name in it)."""
    while name:
        if name in modules() or name in GENERATED:
            return name
        name = name.rpartition(".")[0]
    return None


def _package_of(module: str) -> str:
    return module if modules()[module].name == "__init__.py" else module.rpartition(".")[0]


@cache
def edges(module: str) -> frozenset[str]:
    """Tree modules (generated ones included) that ``module`` imports, anywhere."""
    targets = {_resolve(n) for n in imported_names(modules()[module], _package_of(module))}
    return frozenset(t for t in targets if t is not None and t != module)


@cache
def import_time_edges(module: str) -> frozenset[str]:
    """Tree modules that importing ``module`` loads directly, with their parent packages
    (importing ``a.b`` runs ``a/__init__.py`` first)."""
    names = imported_names(modules()[module], _package_of(module), import_time=True)
    targets = set()
    for name in names:
        resolved = _resolve(name)
        while resolved:
            targets.add(resolved)
            resolved = resolved.rpartition(".")[0]
    return frozenset(t for t in targets if t != module and (t in modules() or t in GENERATED))


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges(v):
            if w not in modules():
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for module in sorted(modules()):
        if module not in index:
            visit(module)
    return found


def _within(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


# ----------------------------------------------------------------------------- the rules

def test_no_import_cycle() -> None:
    assert _cycles() == []


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_imports_point_down(package: str) -> None:
    allowed = MAY_IMPORT[package] | {package}
    bad = {(m, t) for m in modules() if _within(m, [package])
           for t in edges(m) if not _within(t, allowed)}
    assert not bad, sorted(bad)


def _is_sdk(module: str) -> bool:
    return module in SDK_MODULES or _within(module, ["pdserve.v1"])


def test_the_sdk_imports_nothing_of_the_server() -> None:
    sdk = [m for m in modules() if _is_sdk(m)]
    assert {"pdserve", "pdserve.client", "pdserve.aio_client"} <= set(sdk)
    bad = {(m, t) for m in sdk for t in edges(m) if not _is_sdk(t) and t not in GENERATED}
    assert not bad, sorted(bad)


def test_loadtest_imports_only_the_sdk() -> None:
    # locust users run where only the SDK (and locust) is installed
    users = [m for m in modules() if _within(m, ["loadtest"])]
    assert "loadtest.locustfile" in users
    bad = {(m, t) for m in users for t in edges(m) if not (_within(t, ["loadtest"]) or _is_sdk(t))}
    assert not bad, sorted(bad)


def test_servers_never_import_the_sdk_client() -> None:
    servers = [p for p in MAY_IMPORT]
    bad = {(m, t) for m in modules() if _within(m, servers)
           for t in edges(m) if _within(t, ["pdserve"]) and not _within(t, ["pdserve.v1"])}
    assert not bad, sorted(bad)


def test_only_adapters_import_generated_code() -> None:
    importers = {m for m in modules() if not _within(m, ["tools", "bench"])
                 and any(t in GENERATED for t in edges(m))}
    assert importers <= ADAPTERS, sorted(importers - ADAPTERS)
    assert importers == ADAPTERS  # each adapter listed here still is one


def test_worker_kinds_never_import_each_other() -> None:
    for package, other in (("prefill_worker", "decode_worker"), ("decode_worker", "prefill_worker")):
        bad = {(m, t) for m in modules() if _within(m, [package])
               for t in edges(m) if _within(t, [other])}
        assert not bad, sorted(bad)


def _imports_torch_at_import(module: str) -> bool:
    names = imported_names(modules()[module], _package_of(module), import_time=True)
    return any(n.split(".")[0] in TORCH for n in names)


def _loaded_by(module: str) -> set[str]:
    """Every tree module that importing ``module`` loads (statically)."""
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m in seen or m not in modules():
            continue
        seen.add(m)
        todo.extend(import_time_edges(m))
    return seen


@pytest.mark.parametrize("root", TORCH_FREE)
def test_torch_free_modules_never_load_torch(root: str) -> None:
    members = [m for m in modules() if m == root or (root != "pdserve" and _within(m, [root]))]
    assert members, f"{root} is not a module of the tree"
    loaded = set().union(*(_loaded_by(m) for m in members))
    assert not sorted(m for m in loaded if _imports_torch_at_import(m))


def test_torch_free_packages_import_without_torch() -> None:
    result = run_without_torch(
        "import engine, engine.kvcache, engine.core.scheduler, engine.config, engine.tp.sharding\n"
        "import kvtransfer, engine.kvcache.layout, kvtransfer.wire.protocol, kvtransfer.plan\n"
        "import cluster.registry, cluster.heartbeat, cluster.view, cluster.fingerprint\n"
        "import router.server, router.service, router.core, router.lifecycle.handoff, router.api, router.worker_calls\n"
        "import worker.server, worker.loop, worker.options, cluster.pause_points\n"
        "import pdserve, pdserve.cli, deploy.local, deploy.redis_server, deploy.launcher\n"
        "import deploy.ray.options, deploy.ray.plan, deploy.ray.actors, deploy.ray.members\n"
        "import deploy.ray.launcher, deploy.ray.connect\n"
        "assert 'ray' not in sys.modules  # imported only when a cluster starts on Ray\n"
        "assert sys.modules['torch'] is None  # still blocked: nothing replaced or loaded it\n"
        "assert not [m for m in sys.modules if m.startswith('torch.')]\n"
        "assert engine.SamplingParams(max_tokens=1).max_tokens == 1\n"
        "print('ok')\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_import_engine_does_not_load_torch() -> None:
    code = ("import sys\nimport engine, engine.kvcache, engine.core.scheduler, engine.config\n"
            "print('torch' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_engine_llm_is_loaded_lazily() -> None:
    # Accessing engine.LLM imports torch: blocked, it must fail only at that point.
    result = run_without_torch(
        "import engine\ntry:\n    engine.LLM\nexcept ImportError as exc:\n"
        "    print('ImportError', exc.name)\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ImportError torch"


def test_the_sdk_needs_only_grpc_and_protobuf() -> None:
    # pip install pdserve ships the SDK with two dependencies: grpcio and protobuf
    allowed = {*sys.stdlib_module_names, "grpc", "google", "pdserve"}
    bad = {(m, n) for m in modules() if _is_sdk(m)
           for n in imported_names(modules()[m], _package_of(m)) if n.split(".")[0] not in allowed}
    assert not bad, sorted(bad)


def test_cluster_and_router_never_import_the_data_plane() -> None:
    bad = {(m, t) for m in modules() if _within(m, ["cluster", "router"])
           for t in edges(m) if _within(t, ["kvtransfer"])}
    assert not bad, sorted(bad)


def test_the_engine_names_no_worker_kind_not_even_in_a_string() -> None:
    # rank plugins are named by whoever builds the engine (the workers), never by the
    # engine itself: no string of its code (docstrings aside) names a module above it
    above = re.compile(r"\b(worker|prefill_worker|decode_worker|router|deploy|pdserve)\.[a-z_]")
    found = []
    for module, path in modules().items():
        if not _within(module, ["engine"]):
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr)}
        found += [(module, node.value[:60]) for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and id(node) not in docstrings and above.search(node.value)]
    assert not found, found


# ----------------------------------------------------------------------------- sizes

MAX_FILE_LINES = 400
MAX_CLASS_LINES = 250
SHIPPED = ("engine", "kvtransfer", "cluster", "worker", "prefill_worker", "decode_worker",
           "router", "deploy", "pdserve")
# shipped files allowed past MAX_FILE_LINES, each with its reason
LONG_FILES = {
    "cluster/internal/v1/worker_pb2_grpc.py": "generated by grpcio-tools (tools/protogen)",
}


def _shipped_sources() -> list[Path]:
    return sorted(p for package in SHIPPED for suffix in ("*.py", "*.c", "*.h")
                  for p in (REPO_ROOT / package).rglob(suffix))


def test_no_shipped_file_is_over_400_lines() -> None:
    long = {str(p.relative_to(REPO_ROOT)): len(p.read_text().splitlines())
            for p in _shipped_sources()}
    over = {name: n for name, n in long.items()
            if n > MAX_FILE_LINES and name not in LONG_FILES}
    assert not over, over
    assert all(long.get(name, 0) > MAX_FILE_LINES for name in LONG_FILES)  # still needed


def test_no_class_is_over_250_lines() -> None:
    over = []
    for path in _shipped_sources():
        if path.suffix != ".py" or "_pb2" in path.name:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                size = node.end_lineno - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    over.append((str(path.relative_to(REPO_ROOT)), node.name, size))
    assert not over, over


# ----------------------------------------------------------------------------- the checker

def test_the_checker_sees_nested_and_relative_imports(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from torch import nn\n")
    assert "torch" in imported_names(sample, "x")
    sample.write_text("def f():\n    import torch.nn.functional as F\nfrom . import sibling\n"
                      "from ..up import thing\n")
    assert {"torch.nn.functional", "a.b.sibling", "a.up.thing"} <= imported_names(sample, "a.b")
    assert _resolve("engine.config.EngineConfig") == "engine.config"
    assert _resolve("cluster.internal.v1.worker_pb2") in GENERATED
    assert "router.core" in edges("router.service")
    sample.write_text("import os\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    import torch\ndef f():\n    import numpy\nclass C:\n    import json\n")
    assert imported_names(sample, "x", import_time=True) == {"os", "typing", "typing.TYPE_CHECKING",
                                                             "json"}
    assert {"engine", "engine.kvcache"} <= import_time_edges("engine.core.scheduler")


def test_the_cycle_finder_finds_a_cycle(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = {"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a"}),
            "d": frozenset({"a"})}
    monkeypatch.setattr(sys.modules[__name__], "modules", lambda: dict.fromkeys(fake))
    monkeypatch.setattr(sys.modules[__name__], "edges", lambda m: fake[m])
    assert _cycles() == [["a", "b", "c"]]
