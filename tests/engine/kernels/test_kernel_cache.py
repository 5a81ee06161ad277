"""The compiled kernels' cache (engine/kernels/cpu/cache.py): a library planted where
another user can write is refused, never loaded; builders of one directory compile
once between them; a killed build's temporaries are removed; a library that does not
match its digest is compiled again, never loaded. Real files in a private
``XDG_CACHE_HOME`` and the real compiler (``$CC``: a wrapper that logs each compile)."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import engine.kernels.cpu as kernels_package
from engine.kernels.cpu.build import build, library_path
from engine.kernels.cpu.cache import (
    BuildError,
    DamagedLibraryError,
    UntrustedCacheError,
    load,
    locked,
    sidecar,
)
from engine.kernels.cpu.library import NativeKernels

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[3]
REAL_CC = next((shutil.which(c) for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
needs_cc = pytest.mark.skipif(REAL_CC is None, reason="no C compiler here")
GARBAGE = b"\x7fELF not a library, and never to be loaded\n" * 50


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private ``XDG_CACHE_HOME`` and a ``$CC`` that logs each compile (``-o``) to
    ``compiles.log`` beside it; returns the cache home."""
    home = tmp_path / "cache"
    home.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    monkeypatch.setenv("CC", str(_logging_cc(tmp_path)))
    monkeypatch.delenv("PDSERVE_CPU_KERNELS_MARCH", raising=False)
    return home


def _logging_cc(tmp_path: Path, pause_s: float = 0.0, real: str | None = None) -> Path:
    """A compiler wrapper that appends a line to ``compiles.log`` for each compile,
    waits ``pause_s`` seconds, then runs the real compiler."""
    wrapper = tmp_path / f"cc-logging-{pause_s:g}s"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'case " $* " in *" -o "*) echo "$$" >> "{tmp_path}/compiles.log"; sleep {pause_s};; esac\n'
        f'exec "{real or REAL_CC}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def _compiles(tmp_path: Path) -> int:
    log = tmp_path / "compiles.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def _plant(library: Path, data: bytes = GARBAGE) -> None:
    """``data`` as ``library``, with its correct digest beside it, in private directories."""
    library.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    for d in (library.parent, library.parent.parent):
        d.chmod(0o700)
    library.write_bytes(data)
    sidecar(library).write_text(hashlib.sha256(data).hexdigest())
    library.chmod(0o755)
    sidecar(library).chmod(0o644)


@pytest.fixture
def cdll_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names ``ctypes.CDLL`` is asked to load from now on (it still loads them)."""
    calls: list[str] = []
    real = ctypes.CDLL

    def recording(name: str, *args: Any, **kwargs: Any) -> ctypes.CDLL:
        calls.append(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(ctypes, "CDLL", recording)
    return calls


def _assert_refused(library: Path, cdll_calls: list[str], match: str,
                    caplog: pytest.LogCaptureFixture) -> None:
    """``build``, ``load`` and the engine's own loading all refuse, nothing is loaded,
    and the planted file is left as it was."""
    with pytest.raises(UntrustedCacheError, match=match) as refused:
        build()
    assert "XDG_CACHE_HOME" in str(refused.value)
    with pytest.raises(UntrustedCacheError, match=match):
        load(library)
    with caplog.at_level(logging.WARNING, logger="engine.kernels.cpu"):
        assert kernels_package._load() is None  # the engine runs its torch kernels
    assert "refusing pdserve's kernel cache" in caplog.text
    assert cdll_calls == []
    assert library.read_bytes() == GARBAGE


@needs_cc
@pytest.mark.parametrize("shared", ["kernels", "pdserve"])
def test_a_library_planted_in_a_directory_others_can_write_is_refused(
        cache_home: Path, shared: str, cdll_calls: list[str],
        caplog: pytest.LogCaptureFixture) -> None:
    """Garbage with its correct digest, in a kernels (or pdserve) directory that is
    group- and world-writable: refused, never loaded, never replaced."""
    library = library_path()
    _plant(library)
    directory = library.parent if shared == "kernels" else library.parent.parent
    directory.chmod(0o777)
    _assert_refused(library, cdll_calls, rf"{directory}: its group or other users can write.*"
                    r"0777.*chmod go-w", caplog)
    assert _compiles(cache_home.parent) == 0


@needs_cc
@pytest.mark.parametrize("planted", ["library o+w", "library g+w", "digest o+w",
                                     "library symlink", "library foreign", "kernels symlink",
                                     "kernels foreign"])
def test_a_planted_file_in_a_private_directory_is_refused_when_others_could_write_it(
        cache_home: Path, planted: str, cdll_calls: list[str],
        caplog: pytest.LogCaptureFixture) -> None:
    """The directories are private, but the library or its digest is writable by
    others, a symlink or someone else's; or the kernels directory is a symlink or
    someone else's."""
    library = library_path()
    _plant(library)
    what, how = planted.split()
    path = {"library": library, "digest": sidecar(library), "kernels": library.parent}[what]
    if how == "foreign":
        if os.geteuid() != 0:
            pytest.skip("only root can give a file to another user")
        os.chown(path, 65534, 65534)
        match = rf"{path}: it belongs to .*65534"
    elif how == "symlink":
        elsewhere = cache_home / f"elsewhere-{what}"
        path.rename(elsewhere)
        path.symlink_to(elsewhere)
        match = rf"{path}: it is a symlink"
    else:
        path.chmod(path.stat().st_mode | (0o002 if how == "o+w" else 0o020))
        match = rf"{path}: its group or other users can write to it.*rm {path}"
    _assert_refused(path / library.name if what == "kernels" else library, cdll_calls,
                    match, caplog)


_RACER = """
import sys, time
from pathlib import Path
import torch
from engine.kernels.cpu import native
ready = Path(sys.argv[1])
(ready / sys.argv[2]).touch()
deadline = time.monotonic() + 60
while len(list(ready.iterdir())) < 2:  # start building together
    assert time.monotonic() < deadline, "the other process never came"
    time.sleep(0.005)
kernels = native()
assert kernels is not None
x, w = torch.randn(2, 16), torch.randn(8, 16)
torch.testing.assert_close(kernels.gemv(x, w), x @ w.T, rtol=1e-5, atol=1e-4)
print(kernels.path)
"""


@needs_cc
def test_two_processes_building_at_once_compile_once(cache_home: Path, tmp_path: Path) -> None:
    """Two workers start together on an empty cache: one compiles (slowed to 1.5 s, so
    the other surely arrives meanwhile), the other waits for the lock and loads what
    it built; both compute with it."""
    ready = tmp_path / "ready"
    ready.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_CPU_KERNELS"}
    env["CC"] = str(_logging_cc(tmp_path, pause_s=1.5))
    racers = [subprocess.Popen([sys.executable, "-c", _RACER, str(ready), str(i)], cwd=ROOT,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True) for i in range(2)]
    outputs = []
    try:
        for racer in racers:
            out, err = racer.communicate(timeout=100)
            assert racer.returncode == 0, err[-3000:]
            outputs.append(out.strip())
    finally:
        for racer in racers:
            racer.kill()
    assert outputs[0] == outputs[1] and Path(outputs[0]).parent == cache_home / "pdserve" / "kernels"
    assert _compiles(tmp_path) == 1
    names = sorted(p.name for p in Path(outputs[0]).parent.iterdir())
    assert names == ["build.lock", Path(outputs[0]).name, Path(outputs[0]).name + ".sha256"]


_KILLED = """
from engine.kernels.cpu.build import build
build()
"""


@needs_cc
def test_the_temporaries_of_a_killed_build_are_removed_by_the_next(cache_home: Path,
                                                                   tmp_path: Path) -> None:
    """A build killed while it compiles leaves its temporary directory (and holds the
    lock no more); the next build removes it, and an older version's temporary file,
    once they are older than the build timeout; a recent one it leaves."""
    env = {**os.environ, "CC": str(_logging_cc(tmp_path, pause_s=60))}
    killed = subprocess.Popen([sys.executable, "-c", _KILLED], cwd=ROOT, env=env,
                              start_new_session=True, stderr=subprocess.PIPE)
    kernels_dir = cache_home / "pdserve" / "kernels"
    try:
        deadline = time.monotonic() + 60
        while _compiles(tmp_path) == 0:  # the compiler runs, in the temporary directory
            assert killed.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait(timeout=30)
    (left,) = [p for p in kernels_dir.iterdir() if p.name.startswith(".")]
    assert left.is_dir() and ".so.tmp" in left.name
    legacy = kernels_dir / ".pdserve_kernels-0123456789abcdef.a1b2c3.so"
    recent = kernels_dir / ".pdserve_kernels-fedcba9876543210.so.tmpfresh"
    legacy.write_bytes(b"half a library")
    recent.mkdir()
    old = time.time() - 3600
    for p in (left, legacy):
        os.utime(p, (old, old))

    library = build()  # the wrapper logs this compile too, without the pause
    assert not left.exists() and not legacy.exists() and recent.exists()
    assert sorted(p.name for p in kernels_dir.iterdir()) == sorted(
        ["build.lock", library.name, sidecar(library).name, recent.name])


@needs_cc
@pytest.mark.parametrize("damage", ["library replaced", "digest of another file",
                                    "digest missing"])
def test_a_library_that_does_not_match_its_digest_is_built_again_not_loaded(
        cache_home: Path, tmp_path: Path, damage: str, cdll_calls: list[str]) -> None:
    """Whichever of the pair is not the build's (a torn pair, a damaged file): ``load``
    refuses it unopened, and the next build compiles it again; that one loads and runs."""
    library = build()
    assert _compiles(tmp_path) == 1
    if damage == "library replaced":
        library.write_bytes(GARBAGE)
    elif damage == "digest of another file":
        sidecar(library).write_text(hashlib.sha256(GARBAGE).hexdigest())
    else:
        sidecar(library).unlink()
    with pytest.raises(DamagedLibraryError, match="does not match its digest"):
        load(library)
    assert cdll_calls == []

    assert build() == library and _compiles(tmp_path) == 2
    assert library.read_bytes() != GARBAGE
    assert sidecar(library).read_text() == hashlib.sha256(library.read_bytes()).hexdigest()
    kernels = NativeKernels(load(library), str(library))
    assert len(cdll_calls) == 1 and cdll_calls[0].startswith("/proc/self/fd/")
    x, w = torch.randn(1, 16), torch.randn(8, 16)
    torch.testing.assert_close(kernels.gemv(x, w), x @ w.T, rtol=1e-5, atol=1e-4)
    assert build() == library and _compiles(tmp_path) == 2  # intact now: no compile


@needs_cc
def test_what_a_build_creates_is_private_whatever_the_umask(cache_home: Path,
                                                           tmp_path: Path) -> None:
    """Directories 0o700; the library and digest writable by their owner only, even
    under a umask that lets the group write (0o002): the next process trusts them."""
    before = os.umask(0o002)
    try:
        library = build()
    finally:
        os.umask(before)
    for d in (library.parent, library.parent.parent):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
    for f in (library, sidecar(library), library.parent / "build.lock"):
        assert f.stat().st_mode & 0o022 == 0 and f.stat().st_uid == os.geteuid()
    assert build() == library and _compiles(tmp_path) == 1


def test_the_wait_for_another_build_is_bounded(tmp_path: Path) -> None:
    """A lock held longer than the wait allows (a hung build elsewhere) is an error."""
    directory = tmp_path / "kernels"
    directory.mkdir(mode=0o700)
    with locked(directory, 1.0):
        started = time.monotonic()
        with pytest.raises(BuildError, match=r"waited over 0 s .*build.lock stays locked"):
            with locked(directory, 0.3):
                pass
        assert 0.3 <= time.monotonic() - started < 5
    with locked(directory, 0.3):  # released with its holder
        pass


@needs_cc
def test_a_process_given_a_planted_shared_cache_runs_without_it(cache_home: Path,
                                                                  tmp_path: Path) -> None:
    """A fresh process (as a worker starts) whose XDG_CACHE_HOME holds a planted library in
    a world-writable directory: it loads nothing from there, says why, and computes with
    its torch kernels."""
    library = library_path()
    _plant(library)
    library.parent.chmod(0o777)
    probe = ("import logging, sys\nlogging.basicConfig(level=logging.WARNING)\n"
             "import engine.kernels.cpu as k\nprint('native' if k.native() else 'torch')\n")
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                            text=True, timeout=60, env={**os.environ})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "torch"
    assert "refusing pdserve's kernel cache" in result.stderr
    assert library.read_bytes() == GARBAGE and _compiles(tmp_path) == 0
