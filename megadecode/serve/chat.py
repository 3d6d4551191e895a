"""Chat messages to prompt tokens: the checkpoint's chat template where its tokenizer has one (rendered by
transformers, then tokenized without adding special tokens: the template writes them), else the fallback below.

Fallback (presets, with the byte-level tokenizer, and checkpoints without a template): BOS, then per message
`<|role|>` newline content newline, then `<|assistant|>` newline, e.g. for one user message "Hi":
    BOS "<|user|>\nHi\n<|assistant|>\n"
"""

from __future__ import annotations

ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatError(ValueError):
    """Messages the template cannot render (the message names what is wrong)."""


def render_fallback(messages: list[dict]) -> str:
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


def chat_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the conversation, ending where the assistant's answer starts. `messages`: dicts with a
    `role` (ROLES) and a string `content` (protocol.py has checked both)."""
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.render_chat(messages)
        except Exception as e:  # noqa: BLE001 - templates raise what they like (jinja's TemplateError, ...)
            raise ChatError(f"the model's chat template cannot render these messages: {e}") from None
        return tokenizer.encode(text, add_bos=False)
    return tokenizer.encode(render_fallback(messages), add_bos=True)
