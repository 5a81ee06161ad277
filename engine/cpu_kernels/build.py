"""Compiling ``kernels.c`` into a shared library, once per source, compiler and CPU.

The library goes to ``$XDG_CACHE_HOME/pdserve/kernels/`` (else ``~/.cache/pdserve/``),
named by a hash of what it depends on: the source, the compiler's identity, the flags
and the CPU (``-march=native`` compiles for the CPU it runs on). A fresh build takes
about a second; concurrent builders each compile to a temporary file and rename it into
place, so a reader never sees half a library.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11", "-ffp-contract=fast")
COMPILER_ENV = "CC"
BUILD_TIMEOUT_S = 120.0


class BuildError(RuntimeError):
    """The kernels could not be compiled; the message names the compiler and its output."""


def compiler() -> str:
    """The C compiler to use: ``$CC``, else the first of cc, gcc, clang on ``PATH``."""
    wanted = os.environ.get(COMPILER_ENV)
    if wanted:
        return wanted
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return found
    raise BuildError("no C compiler found (cc, gcc or clang on PATH, or $CC); "
                     "the compiled CPU kernels are unavailable")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdserve" / "kernels"


def _cpu_identity() -> str:
    """The CPU's model and feature flags (what ``-march=native`` compiles for)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return os.uname().machine


def _compiler_identity(cc: str) -> str:
    try:
        done = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildError(f"C compiler {cc!r} does not run: {e}") from e
    if done.returncode != 0:
        raise BuildError(f"C compiler {cc!r} --version failed: {done.stderr.strip()[:500]}")
    return done.stdout


def library_path(source: Path = SOURCE, directory: Path | None = None) -> Path:
    """Where the library for ``source`` on this machine lives (built or not)."""
    cc = compiler()
    digest = hashlib.sha256()
    for part in (source.read_bytes(), _compiler_identity(cc).encode(), " ".join(FLAGS).encode(),
                 _cpu_identity().encode()):
        digest.update(part)
        digest.update(b"\0")
    return (directory or cache_dir()) / f"pdserve_kernels-{digest.hexdigest()[:16]}.so"


def build(source: Path = SOURCE, directory: Path | None = None) -> Path:
    """The path of the built library, compiling it first if it is not there yet.
    Raises ``BuildError`` with the compiler's output when compiling fails."""
    target = library_path(source, directory)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.stem}.", suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [compiler(), *FLAGS, "-o", tmp, str(source), "-lm"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise BuildError(f"compiling the CPU kernels failed ({' '.join(cmd)}):\n"
                             f"{done.stderr.strip()[:4000]}")
        os.replace(tmp, target)
    except subprocess.TimeoutExpired as e:
        raise BuildError(f"compiling the CPU kernels took over {BUILD_TIMEOUT_S:.0f} s") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
