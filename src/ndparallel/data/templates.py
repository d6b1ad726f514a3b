"""Chat templates by name (Axolotl's ``chat_template`` values), written here as Jinja.

Each template renders every message as one block that only appends text, so rendering a conversation prefix
by prefix finds each message's tokens exactly (what ``tokenization`` needs to train assistant turns only).
``bos_token`` / ``eos_token`` are the tokenizer's, passed in by transformers' ``apply_chat_template``.

``tokenizer_default`` is the tokenizer's own template, ``tokenizer_default_fallback_<name>`` the tokenizer's
own or else ``<name>``, and ``jinja`` the source given in ``chat_template_jinja``.
"""

from __future__ import annotations

from ndparallel.errors import ConfigError, DataError


def _blocks(body: str, generation_prompt: str, *, prefix: str = "") -> str:
    """A template rendering each message with ``body`` and the generation prompt at the end."""
    return (
        prefix + "{% for message in messages %}" + body + "{% endfor %}"
        "{% if add_generation_prompt %}" + generation_prompt + "{% endif %}"
    )


_CHATML = _blocks("<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n", "<|im_start|>assistant\n")
# Qwen3's turns: an assistant turn's reasoning trace (``reasoning_content``) inside <think> before its answer.
_QWEN3 = _blocks(
    "<|im_start|>{{ message['role'] }}\n{% if message['role'] == 'assistant' and message.reasoning_content is defined "
    "and message.reasoning_content %}<think>\n{{ message.reasoning_content | trim }}\n</think>\n\n{% endif %}"
    "{{ message['content'] }}<|im_end|>\n",
    "<|im_start|>assistant\n",
)
TEMPLATES = {
    "chatml": _CHATML,
    "qwen3": _QWEN3,
    "qwen_25": _blocks(
        "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n",
        "<|im_start|>assistant\n",
        prefix="{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. "
        "You are a helpful assistant.<|im_end|>\n{% endif %}",
    ),
    "llama3": _blocks(
        "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>",
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        prefix="{{ bos_token }}",
    ),
    "mistral_v1": _blocks(
        "{% if message['role'] == 'user' %}[INST] {{ message['content'] }} [/INST]"
        "{% elif message['role'] == 'system' %}[SYSTEM_PROMPT]{{ message['content'] }}[/SYSTEM_PROMPT]"
        "{% else %} {{ message['content'] }}{{ eos_token }}{% endif %}",
        "",
        prefix="{{ bos_token }}",
    ),
    "gemma": _blocks(
        "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
        "{{ message['content'] | trim }}<end_of_turn>\n",
        "<start_of_turn>model\n",
        prefix="{{ bos_token }}",
    ),
    "phi_3": _blocks("<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n", "<|assistant|>\n"),
    "alpaca": _blocks(
        "{% if message['role'] == 'assistant' %}### Response:\n{{ message['content'] }}{{ eos_token }}\n\n"
        "{% elif message['role'] == 'user' %}### Instruction:\n{{ message['content'] }}\n\n"
        "{% else %}{{ message['content'] }}\n\n{% endif %}",
        "### Response:\n",
    ),
}
DEFAULT = "tokenizer_default"
FALLBACK = "tokenizer_default_fallback_"
JINJA = "jinja"


def check_template_name(name: str | None) -> None:
    """A ValueError naming the valid choices when ``name`` is not a chat template this module knows."""
    if name is None or name in TEMPLATES or name in (DEFAULT, JINJA):
        return
    if name.startswith(FALLBACK) and name[len(FALLBACK) :] in TEMPLATES:
        return
    raise ValueError(
        f"{name!r} is not a chat template here; choose one of {', '.join(TEMPLATES)}, {DEFAULT}, "
        f"{FALLBACK}<name> or {JINJA} (with chat_template_jinja)"
    )


def template_source(
    name: str | None, jinja: str | None, tokenizer_template: str | None, *, setting: str = "chat_template"
) -> str | None:
    """The Jinja source the config asks for: ``name`` (default tokenizer_default, or jinja when ``jinja`` is
    given) resolved against the tokenizer's own template. None when nothing is asked and the tokenizer has none.
    """
    if jinja and name in (None, JINJA):
        return jinja
    if name is None or name == DEFAULT:
        return tokenizer_template
    if name == JINJA:
        raise ConfigError(f"{setting}: jinja needs chat_template_jinja (the template's source)")
    if name.startswith(FALLBACK):
        return tokenizer_template or TEMPLATES[name[len(FALLBACK) :]]
    if name not in TEMPLATES:
        try:
            check_template_name(name)
        except ValueError as exc:
            raise DataError(f"{setting}: {exc}") from None
    return TEMPLATES[name]
