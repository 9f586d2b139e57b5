"""Chat templates: the tokenizer's own Jinja template when it ships one, else a built-in one.

Rendered like Hugging Face renders them (sandboxed Jinja, trim_blocks and lstrip_blocks), so the
templates stored in tokenizer_config.json or GGUF metadata give the same text here as there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cache
from typing import Protocol

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from serving.errors import UserError

# Llama 3 instruct format: a header per turn, each turn closed by <|eot_id|>.
LLAMA3 = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# ChatML, as SmolLM2 uses it (including its default system prompt).
CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class _KnowsTokens(Protocol):
    def token_id(self, text: str) -> int | None: ...


class ChatTemplateError(UserError):
    """A template that does not render for the given messages."""


def resolve(template: str | None, tokenizer: _KnowsTokens) -> str:
    """The template to use: the given one, else the built-in one the vocabulary calls for."""
    if template:
        return template
    if tokenizer.token_id("<|start_header_id|>") is not None:
        return LLAMA3
    return CHATML


def render(
    template: str,
    messages: Sequence[Mapping[str, str]],
    add_generation_prompt: bool,
    bos_token: str,
    eos_token: str,
) -> str:
    for i, message in enumerate(messages):
        if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            raise ChatTemplateError(f"messages[{i}]: needs a string 'role' and a string 'content'")
    try:
        return _compile(template).render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
        )
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from None


@cache
def reads(template: str, key: str) -> bool:
    """Whether `template` puts a message's `key` (a string) into the prompt: a probe message with
    a marker there, rendered, shows the marker or not."""
    marker = "\u2063pathserve-probe\u2063"
    probe = [{"role": "user", "content": "hi", key: marker}, {"role": "assistant", "content": "ok", key: marker}]
    try:
        return marker in _compile(template).render(messages=probe, add_generation_prompt=True, bos_token="", eos_token="")
    except jinja2.TemplateError:
        return False


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


@cache
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = _raise
    return env.from_string(template)
