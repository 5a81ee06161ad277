from __future__ import annotations

from tests.factories import run_without_torch


def test_kvcache_imports_without_torch() -> None:
    result = run_without_torch(
        "import engine.kvcache as kv\n"
        "m = kv.BlockManager(4, 2)\n"
        "assert m.allocate('r', 3) == [0, 1]\n"
        "loaded = [k for k, v in sys.modules.items() if v is not None]\n"
        "assert not [k for k in loaded if k == 'torch' or k.startswith('torch.')]\n"
        "print('ok')\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
