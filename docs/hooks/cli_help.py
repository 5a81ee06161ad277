"""MkDocs hook: a page line ``<!-- pdserve-help: COMMAND -->`` becomes the ``--help`` of
``pdserve COMMAND`` (``<!-- pdserve-help: -->``: of ``pdserve`` itself), rendered from the
command line's own parser at build time, so no page keeps a second copy of any flag.

The parser is the one ``pdserve`` runs (``pdserve.cli``); building it imports only the
standard-library option modules, never a server. An unknown command fails the build.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any

MARKER = re.compile(r"^<!-- pdserve-help:\s*(?P<command>[\w-]*)\s*-->$", re.MULTILINE)
ROOT = Path(__file__).resolve().parents[2]


def _parser() -> argparse.ArgumentParser:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from pdserve.cli import _parser as build

    return build()


def command_help(command: str, width: int = 96) -> str:
    """``pdserve COMMAND --help`` as the command line prints it (``width`` columns)."""
    os.environ["COLUMNS"] = str(width)  # argparse wraps to the terminal's width
    parser = _parser()
    if not command:
        return parser.format_help()
    for action in parser._actions:  # noqa: SLF001 - argparse keeps its subparsers here
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            sub = action.choices.get(command)
            if sub is not None:
                return sub.format_help()
    raise ValueError(f"pdserve-help: no command {command!r}")


def on_page_markdown(markdown: str, **_: Any) -> str:
    def render(match: re.Match[str]) -> str:
        return "```text\n" + command_help(match.group("command")).rstrip() + "\n```"

    return MARKER.sub(render, markdown)
