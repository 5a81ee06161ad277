"""The model's chat template: found, compiled and rendered as Hugging Face does it.

Where it comes from (first found): ``--chat-template FILE``, the model directory's
``chat_template.jinja``, its ``chat_template.json`` (``{"chat_template": ...}``), the
``chat_template`` of ``tokenizer_config.json`` (a string, or a list of named templates:
the one named ``default``). A model without one serves completions only; chat requests get
a 400 that says how to give one.

Rendering follows ``transformers``' ``apply_chat_template``: an
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension and ``{% generation %}`` blocks, ``raise_exception``,
``strftime_now`` and a ``tojson`` filter that keeps non-ASCII characters; the variables
are ``messages``, ``add_generation_prompt``, ``tools`` (None), ``documents`` (None), the
special tokens of ``tokenizer_config.json`` (``bos_token``, ``eos_token``, ``pad_token``,
``unk_token``) and the request's ``chat_template_kwargs``. A template that raises
(``raise_exception``, a sandbox violation, an undefined operation) refuses the
conversation: ``InvalidRequest`` with its message, a 400.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from router.validation import InvalidRequest

SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


class ChatTemplateError(ValueError):
    """The template cannot be read or compiled (the router does not start)."""


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with."""

    source: str
    origin: str  # where it was found, for messages and logs
    special_tokens: dict[str, str] = field(default_factory=dict)
    _compiled: jinja2.Template | None = field(default=None, compare=False, repr=False)

    @classmethod
    def compile(cls, source: str, origin: str,
                special_tokens: dict[str, str] | None = None) -> ChatTemplate:
        try:
            compiled = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"the chat template from {origin} does not compile: "
                                    f"{exc.message} (line {exc.lineno})") from None
        return cls(source, origin, dict(special_tokens or {}), compiled)

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               extra: dict[str, Any] | None = None) -> str:
        """The prompt text of ``messages``; ``InvalidRequest`` when the template refuses."""
        assert self._compiled is not None
        variables = {**self.special_tokens, **(extra or {}), "messages": messages,
                     "add_generation_prompt": add_generation_prompt,
                     "tools": None, "documents": None}
        try:
            return self._compiled.render(**variables)
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
            raise InvalidRequest(f"the chat template refused the messages: "
                                 f"{exc}".rstrip(": ")) from None


def load_chat_template(model_dir: Path, override: Path | None = None) -> ChatTemplate | None:
    """The template (see module doc), or None when the model has none;
    ``ChatTemplateError`` for an unreadable or broken one."""
    config = _read_json(model_dir / "tokenizer_config.json")
    special = {name: token for name in SPECIAL_TOKENS
               if (token := _token_text(config.get(name))) is not None}
    found = _find_source(model_dir, override, config)
    if found is None:
        return None
    source, origin = found
    return ChatTemplate.compile(source, origin, special)


def _find_source(model_dir: Path, override: Path | None,
                 config: dict[str, Any]) -> tuple[str, str] | None:
    if override is not None:
        return _read_text(override), str(override)
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return _read_text(jinja_file), str(jinja_file)
    json_file = model_dir / "chat_template.json"
    from_json = _read_json(json_file).get("chat_template")
    if from_json is not None:
        return _template_text(from_json, json_file), str(json_file)
    from_config = config.get("chat_template")
    if from_config is not None:
        path = model_dir / "tokenizer_config.json"
        return _template_text(from_config, path), str(path)
    return None


def _template_text(value: object, path: Path) -> str:
    """A template given as a string or as a list of ``{"name", "template"}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return str(named["default"])
    raise ChatTemplateError(f"chat_template in {path} must be a string or a list of named "
                            "templates with one named 'default'")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(f"cannot read the chat template {path}: {exc}") from None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ChatTemplateError(f"cannot read {path}: {exc}") from None
    return data if isinstance(data, dict) else {}


def _token_text(token: object) -> str | None:
    """A special token given as a string or as ``{"content": str}`` (an AddedToken)."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


# ------------------------------------------------------------------ the environment

class _GenerationBlocks(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant text for training
    masks in ``transformers``); renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlocks, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
