"""Regenerate the committed protobuf and gRPC modules from ``proto/**/*.proto``.

    python -m tools.protogen           # rewrite the generated modules in the checkout
    python -m tools.protogen --check   # exit 1, naming each stale file, if any is stale

Paths mirror ``proto/`` (``protoc -I proto``, outputs at the repository root), so
``proto/cluster/internal/v1/worker.proto`` becomes ``cluster/internal/v1/worker_pb2.py``
(+ ``.pyi`` and ``_pb2_grpc.py``), importable as ``cluster.internal.v1.worker_pb2``.
The generated modules are committed; ``tests/tools/test_protogen.py`` fails when they
differ from what this module produces, so an edited ``.proto`` cannot ship without them.

Needs ``grpcio-tools`` (a dev/test dependency; its exact version decides the bytes
produced) and a source checkout. Nothing at run time imports this module.
"""

from __future__ import annotations

import argparse
import importlib.resources
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_DIRNAME = "proto"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
# Top-level packages that may hold generated modules (proto packages live under them);
# scanned for orphans even after their last .proto is deleted.
GENERATED_PACKAGE_ROOTS = ("pdserve", "cluster")


class ProtogenError(RuntimeError):
    """protoc failed, the output directory was not empty, or there is no ``proto/``."""


def proto_files(proto_root: Path) -> list[Path]:
    """Every ``.proto`` under ``proto_root``, relative to it, sorted."""
    if not proto_root.is_dir():
        raise ProtogenError(f"no {proto_root}: run from a source checkout")
    return sorted(p.relative_to(proto_root) for p in proto_root.rglob("*.proto"))


def generate(out_dir: Path, proto_root: Path) -> list[Path]:
    """Compile every ``.proto`` under ``proto_root`` into ``out_dir`` (absent or empty).

    Returns the files protoc wrote, relative to ``out_dir``, sorted. Raises
    ``ProtogenError`` when ``out_dir`` is not empty or protoc fails (its message is on
    stderr).
    """
    from grpc_tools import protoc  # dev-only dependency: import on use

    if out_dir.exists() and any(out_dir.iterdir()):
        raise ProtogenError(f"{out_dir} is not empty")
    sources = proto_files(proto_root)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not sources:
        return []
    well_known = importlib.resources.files("grpc_tools") / "_proto"  # google/protobuf/*.proto
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(proto_root / s) for s in sources),
    ]
    if protoc.main(args) != 0:
        raise ProtogenError(f"protoc failed on {[str(s) for s in sources]}")
    return sorted(p.relative_to(out_dir) for p in out_dir.rglob("*") if p.is_file())


def committed_outputs(repo_root: Path) -> list[Path]:
    """Generated modules committed under ``GENERATED_PACKAGE_ROOTS`` and ``proto/``'s tops."""
    tops = {s.parts[0] for s in proto_files(repo_root / PROTO_DIRNAME)}
    tops.update(GENERATED_PACKAGE_ROOTS)
    found = (p for top in tops for p in (repo_root / top).rglob("*_pb2*.py*")
             if p.name.endswith(GENERATED_SUFFIXES))
    return sorted(p.relative_to(repo_root) for p in found)


def stale_files(repo_root: Path = REPO_ROOT) -> list[str]:
    """Regenerate into a temporary directory and compare with ``repo_root``; writes nothing.

    Returns one line per problem (``missing``, ``differs`` or ``orphaned``, then the
    path); empty when the committed generated files are exactly what protoc produces now.
    """
    with tempfile.TemporaryDirectory(prefix="protogen-") as tmp:
        fresh_root = Path(tmp)
        fresh = generate(fresh_root, repo_root / PROTO_DIRNAME)
        problems = []
        for rel in fresh:
            committed = repo_root / rel
            if not committed.is_file():
                problems.append(f"missing  {rel}")
            elif committed.read_bytes() != (fresh_root / rel).read_bytes():
                problems.append(f"differs  {rel}")
        orphans = sorted(set(committed_outputs(repo_root)) - set(fresh))
        problems.extend(f"orphaned {rel}" for rel in orphans)
        return problems


def regenerate(repo_root: Path = REPO_ROOT) -> tuple[list[Path], list[Path]]:
    """Bring the committed generated modules up to date with ``proto/``.

    Rewrites the files whose bytes changed and deletes generated modules whose ``.proto``
    is gone. Returns ``(written, removed)``, paths relative to ``repo_root``.
    """
    with tempfile.TemporaryDirectory(prefix="protogen-") as tmp:
        fresh_root = Path(tmp)
        fresh = generate(fresh_root, repo_root / PROTO_DIRNAME)
        written = []
        for rel in fresh:
            data = (fresh_root / rel).read_bytes()
            target = repo_root / rel
            if not target.is_file() or target.read_bytes() != data:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
                written.append(rel)
    removed = sorted(set(committed_outputs(repo_root)) - set(fresh))
    for rel in removed:
        (repo_root / rel).unlink()
    return written, removed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.protogen", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if any generated file is stale")
    parser.add_argument("--repo-root", type=Path, default=REPO_ROOT,
                        help="checkout holding proto/ (default: %(default)s)")
    args = parser.parse_args(argv)
    repo_root: Path = args.repo_root.resolve()
    try:
        if args.check:
            problems = stale_files(repo_root)
            for line in problems:
                print(line, file=sys.stderr)
            if problems:
                print("generated protobuf code is stale: run `python -m tools.protogen`",
                      file=sys.stderr)
            return 1 if problems else 0
        written, removed = regenerate(repo_root)
        for rel in written:
            print(f"wrote    {rel}")
        for rel in removed:
            print(f"removed  {rel} (its .proto is gone)")
        if not written and not removed:
            print("generated protobuf code is up to date")
    except ProtogenError as e:
        print(f"protogen: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
