"""Chat templates (router.http.chat_template): found where Hugging Face looks, rendered as
``transformers.apply_chat_template`` renders them, sandboxed, and refusing conversations
the template refuses."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from router.http.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from router.validation import InvalidRequest

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi, 日本語?"},
     {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "More"}],
]

# A template in the style of real checkpoints (Llama 3, Qwen): whitespace control,
# raise_exception, tojson, loop controls, a {% generation %} block, bos_token.
RICH_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
    {% if message['role'] == 'system' and not loop.first %}{% continue %}{% endif %}
    <{{ message['role'] }}>{{ message['content'] | tojson }}
    {% if message['role'] == 'assistant' %}{% generation %}[{{ message['content'] }}]{% endgeneration %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}<assistant>{% endif %}
"""


def test_the_tiny_models_template_renders_as_transformers_does(
        model_factory: Callable[..., Path]) -> None:
    from transformers import AutoTokenizer

    for arch in ("llama", "qwen2"):
        model_dir = model_factory(arch)
        template = load_chat_template(model_dir)
        assert template is not None and template.origin.endswith("tokenizer_config.json")
        hf = AutoTokenizer.from_pretrained(str(model_dir))
        for messages in CONVERSATIONS:
            for add in (True, False):
                ours = template.render(messages, add_generation_prompt=add)
                theirs = hf.apply_chat_template(messages, tokenize=False,
                                                add_generation_prompt=add)
                assert ours == theirs
        assert ours.startswith("<s>") == (arch == "llama")  # llama's template places BOS


def test_a_rich_template_renders_as_transformers_does(llama_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(llama_dir))
    ours = ChatTemplate.compile(RICH_TEMPLATE, "test", {"bos_token": "<s>", "eos_token": "</s>"})
    messages = [*CONVERSATIONS[1], {"role": "system", "content": "ignored"}]
    rendered = ours.render(messages)
    assert rendered == hf.apply_chat_template(messages, chat_template=RICH_TEMPLATE,
                                              tokenize=False, add_generation_prompt=True)
    assert '"Hi, 日本語?"' in rendered and "[Yes.]" in rendered and "ignored" not in rendered


def test_raise_exception_refuses_the_conversation() -> None:
    template = ChatTemplate.compile(RICH_TEMPLATE, "test", {"bos_token": "<s>"})
    with pytest.raises(InvalidRequest, match="unknown role tool"):
        template.render([{"role": "tool", "content": "x"}])


def test_kwargs_and_special_tokens_reach_the_template() -> None:
    template = ChatTemplate.compile("{{ eos_token }}|{{ thinking }}|{{ messages | length }}",
                                    "test", {"eos_token": "</s>"})
    assert template.render([{"role": "user", "content": "a"}],
                           extra={"thinking": True}) == "</s>|True|1"


@pytest.mark.parametrize("source", [
    "{{ messages.append(1) }}",  # the environment is immutable
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # no way out of the sandbox
    "{{ messages[0]['content'] + 1 }}",  # a template that fails on the data
])
def test_the_sandbox_refuses_unsafe_or_failing_templates(source: str) -> None:
    template = ChatTemplate.compile(source, "test")
    with pytest.raises(InvalidRequest, match="the chat template refused the messages"):
        template.render([{"role": "user", "content": "a"}])


def _model_dir(tmp_path: Path, config: dict[str, Any]) -> Path:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", **config}))
    return tmp_path


def test_where_the_template_comes_from(tmp_path: Path) -> None:
    model_dir = _model_dir(tmp_path, {})
    assert load_chat_template(model_dir) is None  # none: chat is a 400
    model_dir = _model_dir(tmp_path, {"chat_template": [
        {"name": "tool_use", "template": "tools"}, {"name": "default", "template": "cfg"}]})
    assert _rendered(model_dir) == "cfg"
    (model_dir / "chat_template.json").write_text(json.dumps({"chat_template": "json"}))
    assert _rendered(model_dir) == "json"
    (model_dir / "chat_template.jinja").write_text("jinja {{ bos_token }}")
    assert _rendered(model_dir) == "jinja <s>"
    override = tmp_path / "mine.jinja"
    override.write_text("mine")
    template = load_chat_template(model_dir, override)
    assert template is not None and template.origin == str(override)
    assert template.render([]) == "mine"


def _rendered(model_dir: Path) -> str:
    template = load_chat_template(model_dir)
    assert template is not None
    return template.render([])


def test_broken_or_missing_templates_stop_the_start(tmp_path: Path) -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        load_chat_template(_model_dir(tmp_path, {"chat_template": "{% for %}"}))
    with pytest.raises(ChatTemplateError, match="cannot read the chat template"):
        load_chat_template(_model_dir(tmp_path, {}), tmp_path / "missing.jinja")
    with pytest.raises(ChatTemplateError, match="named 'default'"):
        load_chat_template(_model_dir(tmp_path, {"chat_template": [{"name": "x"}]}))
