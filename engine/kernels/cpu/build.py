"""Compiling the kernels' C sources (every ``*.c`` of this directory, with ``kernels.h``)
into one shared library, once per source, compiler and CPU.

The library goes to ``$XDG_CACHE_HOME/pdserve/kernels/`` (else ``~/.cache/pdserve/kernels/``),
named by a hash of what it depends on: the sources, the compiler's identity, the flags
and the CPU (``-march=native`` compiles for the CPU it runs on; ``PDSERVE_CPU_KERNELS_MARCH``
names another target, e.g. ``x86-64-v3`` for AVX2 machines), with the digest of its
bytes beside it (``.so.sha256``). A fresh build takes about a second.

The cache is trusted only when it is this user's alone (``engine.kernels.cpu.cache``):
its ``kernels`` and ``pdserve`` directories (created with mode 0o700), the library and
its digest must be owned by the current user, writable by no one else and not symlinks.
**An untrusted cache raises** ``UntrustedCacheError`` (a ``BuildError`` naming the path,
its owner and mode and the fix: ``chmod go-w``, delete the file, or a private
``XDG_CACHE_HOME``); nothing of it is loaded, and there is no fallback build elsewhere
(``native()`` logs the error and the engine runs its torch kernels). Builders take
turns under an ``flock`` on the directory's ``build.lock`` (several ranks starting
together compile once; the others wait up to ``LOCK_WAIT_S`` and load what the first
built), compile in a temporary directory inside the cache, and install the digest and
then the library by renames; a library that does not match its digest is never loaded
but built again, and temporaries of killed builds are removed under the lock.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path

from engine.kernels.cpu.cache import (
    LIBRARY_PREFIX,
    BuildError,
    install,
    intact,
    locked,
    make_private,
    sweep,
    temp_dir,
)

SOURCES = Path(__file__).parent  # the directory of the C files (and their header)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11", "-ffp-contract=fast")
COMPILER_ENV = "CC"
MARCH_ENV = "PDSERVE_CPU_KERNELS_MARCH"  # the -march target; default: native
BUILD_TIMEOUT_S = 120.0
# how long a builder waits for another one's build: its compile (at most BUILD_TIMEOUT_S)
# and the hashing, syncing and renaming around it
LOCK_WAIT_S = BUILD_TIMEOUT_S + 30.0
_log = logging.getLogger(__name__)
# /proc/cpuinfo lines naming the CPU and its features (x86: model name, flags; ARM:
# Features and the implementer/part ids), all of which -march=native compiles for
_CPU_LINES = ("model name", "flags", "Features", "CPU implementer", "CPU architecture",
              "CPU variant", "CPU part")


def compiler() -> list[str]:
    """The C compiler's command: ``$CC`` (split like a shell would, e.g. ``ccache gcc``),
    else the first of cc, gcc, clang on ``PATH``."""
    wanted = os.environ.get(COMPILER_ENV, "").strip()
    if wanted:
        return shlex.split(wanted)
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return [found]
    raise BuildError("no C compiler found (cc, gcc or clang on PATH, or $CC); "
                     "the compiled CPU kernels are unavailable")


def cache_dir() -> Path:
    """Where the libraries are cached: ``$XDG_CACHE_HOME/pdserve/kernels`` (else
    ``~/.cache/pdserve/kernels``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdserve" / "kernels"


def _cpu_identity() -> str:
    """The CPU's model and feature lines (what ``-march=native`` compiles for)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = [line for line in f if line.startswith(_CPU_LINES)]
        return "".join(sorted(set(lines))) or os.uname().machine
    except OSError:
        return os.uname().machine


def _compiler_identity(cc: list[str]) -> str:
    try:
        done = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildError(f"C compiler {' '.join(cc)!r} does not run: {e}") from e
    if done.returncode != 0:
        raise BuildError(f"C compiler {' '.join(cc)!r} --version failed: {done.stderr.strip()[:500]}")
    return done.stdout


def _flags(identity: str) -> tuple[str, ...]:
    """``FLAGS``, for the target ``$PDSERVE_CPU_KERNELS_MARCH`` names (default ``native``),
    with clang told to use GNU OpenMP: its own runtime (libomp) would be a second thread
    pool beside the libgomp torch loads."""
    march = os.environ.get(MARCH_ENV, "").strip() or "native"
    if not re.fullmatch(r"[A-Za-z0-9._+-]+", march):
        raise BuildError(f"{MARCH_ENV}={march!r} is not a -march target name")
    flags = tuple(f"-march={march}" if f == "-march=native" else f for f in FLAGS)
    if "clang" in identity.lower():
        return tuple("-fopenmp=libgomp" if f == "-fopenmp" else f for f in flags)
    return flags


def source_files(sources: Path = SOURCES) -> list[Path]:
    """The C files the library is compiled from, and the headers they include, by name."""
    return sorted([*sources.glob("*.c"), *sources.glob("*.h")])


def library_path(sources: Path = SOURCES, directory: Path | None = None) -> Path:
    """Where the library of the C files in ``sources`` on this machine lives (built or
    not)."""
    cc = compiler()
    return _library_path(sources, directory, cc, _compiler_identity(cc))


def _library_path(sources: Path, directory: Path | None, cc: list[str], identity: str) -> Path:
    digest = hashlib.sha256()
    files = source_files(sources)
    if not any(f.suffix == ".c" for f in files):
        raise BuildError(f"no C source in {sources}")
    for part in (*(f.name.encode() + b"\0" + f.read_bytes() for f in files), " ".join(cc).encode(),
                 identity.encode(), " ".join(_flags(identity)).encode(),
                 _cpu_identity().encode()):
        digest.update(part)
        digest.update(b"\0")
    return (directory or cache_dir()) / f"{LIBRARY_PREFIX}{digest.hexdigest()[:16]}.so"


def build(sources: Path = SOURCES, directory: Path | None = None, *, rebuild: bool = False) -> Path:
    """The path of the built library, compiling it first unless an intact one is there
    (``rebuild``: compile in any case), one builder of the directory at a time. Raises
    ``BuildError`` with the compiler's output when compiling fails, and
    ``UntrustedCacheError`` for a cache another user may have written (see the module
    docstring). Load it with ``engine.kernels.cpu.cache.load``, which checks it again."""
    cc = compiler()
    identity = _compiler_identity(cc)
    target = _library_path(sources, directory, cc, identity)
    make_private(target.parent)
    if not rebuild and intact(target):
        return target
    with locked(target.parent, LOCK_WAIT_S):
        sweep(target.parent, BUILD_TIMEOUT_S)
        if rebuild or not intact(target):  # else another process built it while we waited
            _compile(sources, target, cc, identity)
    return target


def _compile(sources: Path, target: Path, cc: list[str], identity: str) -> None:
    """Compile ``target`` in a temporary directory beside it and install it there."""
    started = time.monotonic()
    _log.info("compiling pdserve's CPU kernels for this CPU (once, about a second) ...")
    work = temp_dir(target)
    built = work / target.name
    c_files = [str(f) for f in source_files(sources) if f.suffix == ".c"]
    cmd = [*cc, *_flags(identity), "-o", str(built), *c_files, "-lm"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise BuildError(f"compiling the CPU kernels failed ({' '.join(cmd)}):\n"
                             f"{done.stderr.strip()[:4000]}")
        install(built, target)
        _log.info("compiled pdserve's CPU kernels in %.1f s: %s", time.monotonic() - started, target)
    except subprocess.TimeoutExpired as e:
        raise BuildError(f"compiling the CPU kernels took over {BUILD_TIMEOUT_S:.0f} s") from e
    finally:
        shutil.rmtree(work, ignore_errors=True)
