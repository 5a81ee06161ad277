from __future__ import annotations

import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def test_kvcache_imports_without_torch() -> None:
    # sys.modules[name] = None makes `import name` raise ImportError.
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "import engine.kvcache as kv\n"
        "m = kv.BlockManager(4, 2)\n"
        "assert m.allocate('r', 3) == [0, 1]\n"
        "loaded = [k for k, v in sys.modules.items() if v is not None]\n"
        "assert not [k for k in loaded if k == 'torch' or k.startswith('torch.')]\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
