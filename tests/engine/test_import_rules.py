"""The torch-free boundary: what the router imports must never pull in torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.factories import run_without_torch

REPO_ROOT = Path(__file__).resolve().parents[2]
ENGINE = REPO_ROOT / "engine"
TORCH_FREE_FILES = sorted(
    [*ENGINE.glob("kvcache/*.py")]
    + [ENGINE / name for name in ("scheduler.py", "request.py", "config.py", "sampling_params.py",
                                  "sharding.py")]
)
TORCH_PACKAGES = ("torch", "flash_attn", "triton")


def _imported_modules(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports, at any depth (TYPE_CHECKING too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _imports_torch(path: Path) -> bool:
    return any(name.split(".")[0] in TORCH_PACKAGES for name in _imported_modules(path))


def _module_file(name: str) -> Path | None:
    """The file of engine module ``name`` (package or module), or None if not one."""
    base = REPO_ROOT.joinpath(*name.split("."))
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


@pytest.mark.parametrize("imports", ["import engine",
                                     "import engine.kvcache, engine.scheduler, engine.config"])
def test_torch_free_modules_import_without_torch(imports: str) -> None:
    result = run_without_torch(
        f"{imports}\n"
        "import engine as e\n"
        "assert sys.modules['torch'] is None  # still blocked: nothing replaced or loaded it\n"
        "assert not [m for m in sys.modules if m.startswith('torch.')]\n"
        "assert e.SamplingParams(max_tokens=1).max_tokens == 1\n"
        "print('ok')\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_import_engine_does_not_load_torch() -> None:
    code = (
        "import sys\n"
        "import engine, engine.kvcache, engine.scheduler, engine.config\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_engine_llm_is_loaded_lazily() -> None:
    # Accessing engine.LLM imports torch: blocked, it must fail only at that point.
    result = run_without_torch(
        "import engine\n"
        "try:\n"
        "    engine.LLM\n"
        "except ImportError as exc:\n"
        "    print('ImportError', exc.name)\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ImportError torch"


def test_torch_free_files_exist() -> None:
    names = {p.relative_to(ENGINE).as_posix() for p in TORCH_FREE_FILES}
    assert {"kvcache/__init__.py", "kvcache/block_manager.py", "scheduler.py"} <= names
    assert all(p.is_file() for p in TORCH_FREE_FILES)


@pytest.mark.parametrize("path", TORCH_FREE_FILES, ids=lambda p: p.relative_to(ENGINE).as_posix())
def test_torch_free_files_never_import_torch(path: Path) -> None:
    assert not _imports_torch(path)
    # ... nor another engine module that might: their engine imports stay inside the set
    internal = {_module_file(n) for n in _imported_modules(path) if n.split(".")[0] == "engine"}
    assert internal - {None} <= set(TORCH_FREE_FILES)


def test_static_check_sees_nested_imports(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from torch import nn\n"
    )
    assert _imports_torch(sample)
    sample.write_text("def f():\n    import torch.nn.functional as F\n")
    assert _imports_torch(sample)
    sample.write_text("import torchvision_like\nfrom engine import config\n")
    assert not _imports_torch(sample)
    assert _module_file("engine.config") == ENGINE / "config.py"
    assert _module_file("engine.kvcache") == ENGINE / "kvcache" / "__init__.py"
