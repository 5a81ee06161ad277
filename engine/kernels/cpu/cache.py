"""The compiled kernels' cache directory: trusted only when it is this user's alone,
built into by one process at a time, written so that no reader loads a torn pair.

A cached library is loaded into every worker process, so whoever can write a file
there runs code in all of them. The cache is therefore used only when

- the directory of the libraries (``$XDG_CACHE_HOME/pdserve/kernels``, or the one
  ``build`` is given) and its parent (``pdserve``) are real directories, not symlinks,
  owned by the current user (``os.geteuid()``) and writable by no one else (no bit of
  ``0o022``); the ones missing are created with mode ``0o700``;
- a cached library, its digest (``.so.sha256``) and the lock file are regular files,
  not symlinks, owned by the user and writable by no one else;
- and the library's SHA-256 is the one its digest file names.

**An untrusted cache raises; there is no fallback.** An unsafe directory or file raises
``UntrustedCacheError`` (a ``BuildError``) naming the path, its owner and mode and what
to do (``chmod go-w``, delete a planted file, or set ``XDG_CACHE_HOME`` to a private
directory); nothing in it is loaded, replaced or removed. ``engine.kernels.cpu.native()``
logs that message once and the engine serves with torch's kernels. Building into a
fresh private directory instead would hide the problem and compile again in every
process at every start.

``load`` opens the library once, checks that open file (owner, mode, digest) and loads
that very file (``/proc/self/fd/N``), so what is loaded is what was checked even if a
path is swapped in between; the descriptor stays open while the process runs, so a
later load never meets that name again.

Builders of one directory take turns (``locked``: an ``flock`` on its ``build.lock``
around "check the cache, compile, install"): processes starting together compile once,
the others wait, bounded, and find the library built. A build compiles in a temporary
directory inside the cache directory, writes the digest there, syncs both, renames the
digest into place and then the library (``install``). A reader only takes a library
that matches its digest, so a pair torn by a build killed between the two renames, or
a damaged file, is never loaded but compiled again under the lock. Temporaries of
killed builds (``.pdserve_kernels-*`` older than the build timeout) are removed under
the lock (``sweep``).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import logging
import os
import pwd
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LIBRARY_PREFIX = "pdserve_kernels-"  # a library's name: this, its build's hash, ".so"
TEMP_PREFIX = f".{LIBRARY_PREFIX}"  # a build's temporaries (new and older versions')
LOCK_NAME = "build.lock"
_UNSAFE_BITS = 0o022  # writable by the group or by others
_log = logging.getLogger(__name__)
_pinned: list[int] = []  # descriptors of the libraries loaded, open while the process runs


class BuildError(RuntimeError):
    """The kernels could not be compiled; the message names the compiler and its output."""


class UntrustedCacheError(BuildError):
    """A cache directory or file that another user may have written: not used."""


class DamagedLibraryError(BuildError):
    """A cached library that is missing or does not match its digest: not loaded."""


def sidecar(library: Path) -> Path:
    """The digest file of ``library``: its SHA-256, in hex."""
    return library.with_name(library.name + ".sha256")


def _owner(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def check(path: Path, st: os.stat_result, *, directory: bool) -> None:
    """Raise ``UntrustedCacheError`` unless ``st`` (``path``'s own status, not its
    target's) is a directory (``directory``) or a regular file of this user's that no
    one else may write."""
    kind = "directory" if directory else "file"
    me = os.geteuid()
    fix = f"delete it (rm {path}); pdserve builds it again"
    if stat.S_ISLNK(st.st_mode):
        why = "it is a symlink"
        fix = "replace it with a real directory of yours" if directory else fix
    elif not (stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)):
        why = f"it is not a {'directory' if directory else 'regular file'}"
    elif st.st_uid != me:
        why = f"it belongs to {_owner(st.st_uid)}, not to this user, {_owner(me)}"
        fix = "use a directory of your own" if directory else fix
    elif st.st_mode & _UNSAFE_BITS:
        why = "its group or other users can write to it"
        fix = (f"chmod go-w {path} and remove what you did not put there" if directory
               else fix)
    else:
        return
    raise UntrustedCacheError(
        f"refusing pdserve's kernel cache {kind} {path}: {why} (owner {_owner(st.st_uid)}, "
        f"mode {stat.filemode(st.st_mode)} {st.st_mode & 0o7777:04o}). A library there is "
        f"loaded into every worker, so the cache must be this user's alone: {fix}, or set "
        "XDG_CACHE_HOME to a private directory. The compiled kernels are not used.")


def check_directories(directory: Path) -> None:
    """Check ``directory`` and its parent (``kernels`` and ``pdserve``)."""
    for d in (directory, directory.parent):
        check(d, os.lstat(d), directory=True)


def make_private(directory: Path) -> None:
    """Create ``directory`` and whatever is missing above it with mode ``0o700``, then
    check it and its parent."""
    missing, d = [], directory
    while not os.path.lexists(d) and d != d.parent:
        missing.append(d)
        d = d.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
    check_directories(directory)


def _open(path: Path, flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
    """``path`` opened without following a symlink (nor waiting on a FIFO), checked
    (``check``)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            check(path, os.lstat(path), directory=False)  # raises: a symlink
        raise
    try:
        check(path, os.fstat(fd), directory=False)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read(fd: int) -> bytes:
    with os.fdopen(os.dup(fd), "rb") as f:
        f.seek(0)
        return f.read()


def _matches_digest(fd: int, library: Path) -> bool:
    try:
        side = _open(sidecar(library))
    except FileNotFoundError:
        return False
    try:
        wanted = _read(side).decode("ascii", "replace").strip()
    finally:
        os.close(side)
    return hashlib.sha256(_read(fd)).hexdigest() == wanted


def open_verified(library: Path) -> int | None:
    """A descriptor of ``library``, open for reading, if it and its digest file are
    trusted (``check``) and match; ``None`` when either is missing or they differ.
    Raises ``UntrustedCacheError`` for a file that may not be used."""
    try:
        fd = _open(library)
    except FileNotFoundError:
        return None
    ok = False
    try:
        ok = _matches_digest(fd, library)
    finally:
        if not ok:
            os.close(fd)
    return fd if ok else None


def intact(library: Path) -> bool:
    """Whether ``library`` is there, trusted and the file its build wrote (its digest
    matches): a file cut short would crash the loader (SIGBUS), not raise."""
    fd = open_verified(library)
    if fd is None:
        return False
    os.close(fd)
    return True


def load(library: Path) -> ctypes.CDLL:
    """``library`` loaded, after checking its directory, itself and its digest: the file
    descriptor checked is the one loaded (through ``/proc/self/fd``, where there is
    one). Raises ``UntrustedCacheError`` or ``DamagedLibraryError`` without loading, or
    ``OSError`` where the loader refuses the file."""
    check_directories(library.parent)
    fd = open_verified(library)
    if fd is None:
        raise DamagedLibraryError(f"{library} is missing or does not match its digest "
                                  f"{sidecar(library)}; not loaded")
    via = f"/proc/self/fd/{fd}"
    try:
        loaded = ctypes.CDLL(via if os.path.exists(via) else str(library))
    except BaseException:
        os.close(fd)
        raise
    _pinned.append(fd)
    return loaded


@contextmanager
def locked(directory: Path, timeout: float) -> Iterator[None]:
    """Hold the build lock of ``directory`` (``flock`` on its ``build.lock``), waiting at
    most ``timeout`` seconds for another process's build; ``BuildError`` after that."""
    path = directory / LOCK_NAME
    fd = _open(path, os.O_RDWR | os.O_CREAT)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise BuildError(
                        f"waited over {timeout:.0f} s for another process's build of the CPU "
                        f"kernels ({path} stays locked); is a compiler hanging?") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # and the lock with it


def sweep(directory: Path, max_age: float) -> list[str]:
    """Remove the temporaries of builds killed before they finished (``.pdserve_kernels-*``
    entries not changed for ``max_age`` seconds); call it holding the lock. Returns the
    names removed."""
    removed, now = [], time.time()
    with os.scandir(directory) as entries:
        for entry in entries:
            if not entry.name.startswith(TEMP_PREFIX):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
                if now - st.st_mtime < max_age:
                    continue  # perhaps a live build of a pdserve that takes no lock
                if stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
                removed.append(entry.name)
            except OSError as e:
                _log.warning("could not remove %s, left by a killed build: %s", entry.path, e)
    if removed:
        _log.info("removed %d temporaries of killed kernel builds in %s", len(removed), directory)
    return removed


def temp_dir(library: Path) -> Path:
    """A new private directory beside ``library`` to build it in (``sweep`` removes it
    when a killed build leaves it)."""
    return Path(tempfile.mkdtemp(prefix=f".{library.name}.tmp", dir=library.parent))


def _fsync(path: Path, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def install(built: Path, library: Path) -> None:
    """Move the library ``built`` (in ``temp_dir(library)``) to ``library`` with its digest:
    both synced, the digest renamed into place first, the library last, then the
    directory synced. A reader sees either pair complete or a library that does not
    match its digest, never takes the latter, and rebuilds it under the lock."""
    os.chmod(built, 0o755)  # whatever the umask: the check refuses g+w and o+w
    _fsync(built)
    digest = built.with_name(built.name + ".sha256")
    fd = os.open(digest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        os.fchmod(fd, 0o644)
        os.write(fd, hashlib.sha256(built.read_bytes()).hexdigest().encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(digest, sidecar(library))
    os.replace(built, library)
    _fsync(library.parent, os.O_DIRECTORY)
