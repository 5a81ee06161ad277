"""Publishing a built directory into the model cache at once: it is built in a temporary
sibling and renamed into place, so a present directory is complete; when a concurrent
builder wins the rename, its copy is used and ours is discarded."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def built_once(final: Path, build: Callable[[Path], object]) -> Path:
    """``final``, built by ``build(tmp)`` into a temporary sibling and renamed there unless
    it exists already."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(tmp)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
