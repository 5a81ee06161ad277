"""The user guide (``docs/``, MkDocs): it builds with ``--strict`` (a broken link, a page
missing from the nav or an API reference to a name that does not exist fails), and every
command's flags on it come from that command's own ``--help``."""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cli import _parser
from tests.factories import REPO_ROOT

pytestmark = pytest.mark.timeout(300)

DOCS = REPO_ROOT / "docs"
HOOK = DOCS / "hooks" / "cli_help.py"


def _hook():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("cli_help", HOOK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _commands() -> list[str]:
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(sub.choices)


def test_the_documentation_builds_strict(tmp_path: Path) -> None:
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=240,
                          env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    page = (site / "operations" / "local-cluster" / "index.html").read_text()
    assert "usage: pdserve up" in page and "--prefill-tp" in page  # rendered from the parser
    assert "vllm:num_requests_running" in (site / "operations" / "metrics" / "index.html"
                                           ).read_text()  # the metrics module's docstring


def test_every_command_has_its_help_on_a_page() -> None:
    markers = {m.group(1) for page in DOCS.rglob("*.md")
               for m in re.finditer(r"<!-- pdserve-help:\s*([\w-]*)\s*-->", page.read_text())}
    assert markers >= set(_commands()), sorted(set(_commands()) - markers)


def test_the_help_hook_renders_the_parser_and_refuses_unknown_commands() -> None:
    hook = _hook()
    text = hook.on_page_markdown("before\n<!-- pdserve-help: router -->\nafter")
    assert text.startswith("before\n```text\nusage: pdserve router") and text.endswith("after")
    assert "--lease-ttl" in text  # a flag only the router's parser knows
    with pytest.raises(ValueError, match="no command"):
        hook.on_page_markdown("<!-- pdserve-help: no-such-command -->")


def test_no_page_keeps_a_hand_written_copy_of_a_commands_usage() -> None:
    # a fenced block that starts like `pdserve up [--model DIR] ...` is a second copy
    pattern = re.compile(r"^(\.venv/bin/)?pdserve [\w-]+ \[--", re.MULTILINE)
    copies = [str(p.relative_to(REPO_ROOT)) for p in [*DOCS.rglob("*.md"), REPO_ROOT / "README.md"]
              if pattern.search(p.read_text())]
    assert copies == []
