"""Tokenizers: a built-in byte-level one for presets, the checkpoint's own (via transformers) otherwise."""

from __future__ import annotations

from pathlib import Path

BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
BYTE_VOCAB_SIZE = 259


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; BOS, EOS and PAD follow."""

    bos_token_id = BOS_ID
    eos_token_id = EOS_ID
    vocab_size = BYTE_VOCAB_SIZE

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return ([BOS_ID] if add_bos else []) + list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """The checkpoint's own tokenizer files, read with transformers (no hub access)."""

    def __init__(self, path: str | Path):
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.eos_token_id = self._tok.eos_token_id

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_bos))

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    @property
    def chat_template(self) -> str | None:
        """The checkpoint's chat template (tokenizer_config.json or chat_template.jinja), None without one."""
        return getattr(self._tok, "chat_template", None) or None

    def render_chat(self, messages: list[dict]) -> str:
        """The conversation as the template writes it, ending with the assistant's turn (encode with
        add_bos=False: the template writes its own special tokens)."""
        return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def load_tokenizer(checkpoint_dir: str | Path | None):
    """Byte tokenizer for presets (None) or a checkpoint without tokenizer files."""
    if checkpoint_dir is not None:
        d = Path(checkpoint_dir)
        if any((d / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            return HFTokenizer(d)
    return ByteTokenizer()
