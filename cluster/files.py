"""Small file helpers shared by pdserve processes and tests. Torch-free, stdlib only."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write ``data`` as JSON so that readers never see a partial file (write a sibling
    temp file, then rename it over ``path``)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, sort_keys=True))
    os.replace(tmp, path)
