"""Chat messages -> one prompt string.

A model whose tokenizer carries a chat template (a Hugging Face ``tokenizer_config.json`` with
``chat_template``, as every Qwen3 checkpoint has) is prompted through that template, with the
generation prompt appended. The shipped byte-level pair ``kvstrata-tiny-py`` was trained on raw
Python source and has no template; for it (and any model without one) the server uses this
minimal, documented one (``docs/serving.md``)::

    <role>: <content>\\n        one line per message, in order (content kept verbatim)
    assistant:                  the generation prompt (a space after the colon)

so ``[{"role": "user", "content": "def add(a, b):"}]`` becomes ``"user: def add(a, b):\\nassistant: "``.
"""

from __future__ import annotations

from typing import Sequence

MINIMAL_TEMPLATE = "kvstrata-minimal-v1"


def render_minimal(messages: Sequence[dict[str, str]]) -> str:
    """The minimal template above (for models whose tokenizer has no chat template)."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


def render_chat(tokenizer, messages: Sequence[dict[str, str]]) -> str:
    """The tokenizer's template when it has one, else :func:`render_minimal`.

    Raises ``ValueError`` (one line) when the template rejects the messages.
    """
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(list(messages))
    return render_minimal(messages)


def template_name(tokenizer) -> str:
    """What ``/v1/models`` reports as the chat template in use."""
    return "tokenizer" if getattr(tokenizer, "chat_template", None) else MINIMAL_TEMPLATE
