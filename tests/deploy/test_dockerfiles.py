"""Static checks of the container images' Dockerfiles (no Docker engine needed): pinned
base images, torch pinned, the package installed with its ``server`` extra, a non-root
user before the ``pdserve`` entry point, and COPY sources that exist in the build context."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.deploy.chart import CHART_DIR, REPO_ROOT

DOCKER_DIR = REPO_ROOT / "deploy" / "docker"
DOCKERFILES = {"Dockerfile": "cpu", "Dockerfile.cuda": "cu128"}
TORCH_VERSION = "2.13.0"
EXACT_VERSION = re.compile(r"\d+\.\d+\.\d+")


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case
    value: str    # the rest, continuation lines joined, ARG defaults substituted


def _instructions(path: Path) -> list[Instruction]:
    """The Dockerfile's instructions: comments dropped, ``\\`` continuations joined, and
    ``${NAME}`` / ``$NAME`` replaced by the default of the ARG of that name."""
    logical, pending = [], ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, f"{path.name} ends inside a continued line"
    args: dict[str, str] = {}
    result = []
    for line in logical:
        keyword, _, value = line.strip().partition(" ")
        value = re.sub(r"\$\{(\w+)\}|\$(\w+)",
                       lambda m: args.get(m[1] or m[2], m[0]), value.strip())
        if keyword.upper() == "ARG" and "=" in value:
            name, default = value.split("=", 1)
            args[name] = default.strip('"')
        result.append(Instruction(keyword.upper(), value))
    return result


def _stages(instructions: list[Instruction]) -> list[list[Instruction]]:
    stages: list[list[Instruction]] = []
    for ins in instructions:
        if ins.keyword == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(ins)
    return stages


@pytest.fixture(params=sorted(DOCKERFILES), ids=lambda name: name)
def dockerfile(request: pytest.FixtureRequest) -> tuple[str, list[Instruction]]:
    return request.param, _instructions(DOCKER_DIR / request.param)


def test_base_images_pinned_to_exact_versions(dockerfile: tuple[str, list[Instruction]]) -> None:
    name, instructions = dockerfile
    stage_names: set[str] = set()
    for ins in instructions:
        if ins.keyword != "FROM":
            continue
        image, *rest = ins.value.split()
        if rest[:1] == ["AS"] or rest[:1] == ["as"]:
            stage_names.add(rest[1])
        if image in stage_names:
            continue
        repository, _, tag = image.partition("@")[0].rpartition(":")
        assert repository and tag and tag != "latest", f"{name}: {image} is not pinned"
        assert EXACT_VERSION.search(tag), f"{name}: {image}: the tag is no exact version"
    bases = {i.value.split()[0] for i in instructions if i.keyword == "FROM"} - stage_names
    expected = ({"python:3.11.9-slim-bookworm"} if name == "Dockerfile"
                else {"nvidia/cuda:12.8.1-runtime-ubuntu22.04"})
    assert bases == expected


def test_torch_pinned_and_the_server_extra_installed(
        dockerfile: tuple[str, list[Instruction]]) -> None:
    name, instructions = dockerfile
    flavour = DOCKERFILES[name]
    runs = [shlex.split(i.value) for i in instructions if i.keyword == "RUN"]
    pins = [w for words in runs for w in words if w.startswith("torch")]
    local = "" if flavour == "cpu" else f"+{flavour}"
    assert pins and set(pins) == {f"torch=={TORCH_VERSION}{local}"}, pins
    index = f"https://download.pytorch.org/whl/{flavour}"
    assert any(index in words and f"torch=={TORCH_VERSION}{local}" in words for words in runs)
    copies = [i.value.split() for i in instructions if i.keyword == "COPY"
              and not i.value.startswith("--from")]
    (destination,) = {words[-1] for words in copies}
    assert any(f"{destination}[server]" in words for words in runs), "pip install '.[server]'"


def test_non_root_user_before_the_pdserve_entrypoint(
        dockerfile: tuple[str, list[Instruction]]) -> None:
    name, instructions = dockerfile
    final = _stages(instructions)[-1]
    keywords = [i.keyword for i in final]
    assert "USER" in keywords and "ENTRYPOINT" in keywords
    last_user = max(i for i, k in enumerate(keywords) if k == "USER")
    entrypoint = keywords.index("ENTRYPOINT")
    assert last_user < entrypoint, f"{name}: USER must come before ENTRYPOINT"
    user = final[last_user].value.split(":")[0]
    assert user not in ("root", "0") and user.isdigit(), f"{name}: USER {user}"
    assert json.loads(final[entrypoint].value) == ["pdserve"]
    # the user is the one the chart's pods run as
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    assert int(user) == values["podSecurityContext"]["runAsUser"]
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["pdserve"] == "pdserve.cli:main"  # what the entry point runs


def test_copy_sources_exist(dockerfile: tuple[str, list[Instruction]]) -> None:
    name, instructions = dockerfile
    assert not [i for i in instructions if i.keyword == "ADD"], "COPY, not ADD"
    for ins in instructions:
        if ins.keyword != "COPY" or ins.value.startswith("--from"):
            continue
        *sources, _destination = [w for w in ins.value.split() if not w.startswith("--")]
        for source in sources:
            assert (REPO_ROOT / source).exists(), f"{name}: COPY {source}: not in the repository"


def test_exposed_ports_are_the_chart_ports(dockerfile: tuple[str, list[Instruction]]) -> None:
    _, instructions = dockerfile
    exposed = {int(p) for i in instructions if i.keyword == "EXPOSE" for p in i.value.split()}
    assert exposed == {50051, 8000, 8081, 50061, 50071, 9090}


def _dockerignore() -> list[str]:
    lines = (REPO_ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule, as far as this repository's .dockerignore needs it: the last matching
    pattern wins; ``!`` re-includes; a pattern also matches everything under a match."""
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        parts = Path(path).parts
        prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
        candidates = [pattern, pattern.removeprefix("**/")]
        if any(fnmatch.fnmatchcase(p, c) for p in prefixes for c in candidates):
            ignored = not negate
    return ignored


def test_dockerignore_keeps_what_the_install_needs() -> None:
    patterns = _dockerignore()
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {d.name for d in REPO_ROOT.iterdir() if (d / "__init__.py").is_file()
                and any(fnmatch.fnmatchcase(d.name, pattern) for pattern in include)}
    shipped = packages - {"bench"}  # benchmarks are not shipped
    assert {"pdserve", "router", "engine"} <= shipped
    for needed in sorted(shipped) + ["pyproject.toml", config["project"]["readme"]]:
        assert not _ignored(needed, patterns), f".dockerignore drops {needed}"
    assert not _ignored("pdserve/cli.py", patterns)
    for junk in (".git", ".venv", "tests", "pdserve/__pycache__/cli.cpython-311.pyc"):
        assert _ignored(junk, patterns), f".dockerignore lets {junk} into the image"
