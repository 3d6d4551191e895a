"""Structured output: a sequence's text held to a guide (a JSON schema, any JSON object, a regular expression, one
of a list of strings, an EBNF grammar). xgrammar compiles the guide into a grammar over the tokenizer's vocabulary
(`Grammars`, one per server: its compiler caches what it compiled); each sequence gets its own matcher (`Guide`),
which before every sampling fills the sequence's row of a bitmask of the tokens allowed next (the sampler applies it
to the logits on the device, `apply_guides`) and then takes the sampled token. When the grammar is complete only the
stop tokens (the model's EOS) are allowed; a guide that has taken its last token ends the sequence (`Guide.done`).

xgrammar comes with the serve extra (`pip install -e ".[serve]"`); without it a guided request is refused naming
the package, and nothing else changes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import torch

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


class GuideError(ValueError):
    """A guide that cannot be compiled (a schema or regex xgrammar does not take), or structured output without
    xgrammar; the message says which."""


@dataclass(frozen=True)
class GuideSpec:
    """What a request asks its text to match. `value`: the schema (JSON text), the regex, the choices (a JSON list
    of strings), or an EBNF grammar (xgrammar's, GBNF-like, its start rule `root`); empty for json_object (any JSON
    object)."""

    kind: str
    value: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise GuideError(f"unknown guide kind {self.kind!r} (one of {', '.join(KINDS)})")


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:  # the serve extra is not installed
        raise GuideError("structured output needs xgrammar: pip install -e '.[serve]'") from e
    return xgrammar


def _message(e: Exception) -> str:
    """xgrammar's error without its timestamp and source location ("[hh:mm:ss] /path/file.cc:123: ")."""
    return re.sub(r"^\[[\d:]+\]\s*\S+:\d+:\s*", "", str(e).strip()).splitlines()[0] if str(e).strip() else repr(e)


def tokenizer_info(tokenizer, vocab_size: int, stop_ids: tuple[int, ...]):
    """xgrammar's view of the vocabulary: the byte tokenizer's ids 0..255 are single bytes and its BOS / EOS / PAD
    special (never text); a checkpoint's tokenizer is read through transformers. `vocab_size`: the model's (its
    logits' width, which may pad past the tokenizer's), `stop_ids`: the tokens allowed once the grammar is done."""
    from .tokenizer import BYTE_VOCAB_SIZE, ByteTokenizer

    xgr = _xgrammar()
    if isinstance(tokenizer, ByteTokenizer):
        vocab = [bytes([i]) for i in range(256)] + [b""] * (BYTE_VOCAB_SIZE - 256)
        return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=list(stop_ids))
    hf = getattr(tokenizer, "_tok", None)
    if hf is None:
        raise GuideError(f"structured output needs a byte or Hugging Face tokenizer, got {type(tokenizer).__name__}")
    return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=list(stop_ids))


class Grammars:
    """Compiles guides for one tokenizer (thread-safe: xgrammar's compiler caches and locks)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: tuple[int, ...]):
        self._xgr = _xgrammar()
        self.vocab_size = vocab_size
        self.compiler = self._xgr.GrammarCompiler(tokenizer_info(tokenizer, vocab_size, stop_ids), max_threads=2)

    def compile(self, spec: GuideSpec):
        """The compiled grammar of `spec`, or GuideError naming what xgrammar refused. JSON without extra
        whitespace between tokens (a model left free to emit whitespace can emit nothing else)."""
        try:
            if spec.kind == "json_schema":
                return self.compiler.compile_json_schema(spec.value, any_whitespace=False)
            if spec.kind == "json_object":
                return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.kind == "regex":
                return self.compiler.compile_regex(spec.value)
            if spec.kind == "grammar":
                return self.compiler.compile_grammar(spec.value)
            choices = json.loads(spec.value)  # each a string literal of the grammar, JSON's escapes being EBNF's
            return self.compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in choices))
        except RuntimeError as e:
            raise GuideError(f"the {spec.kind.replace('_', ' ')} cannot be compiled: {_message(e)}") from None

    def guide(self, compiled) -> "Guide":
        return Guide(self._xgr.GrammarMatcher(compiled), self.vocab_size)


class Guide:
    """One sequence's matcher: the tokens it took, and which may follow."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Take a sampled token; False when the grammar does not allow it (the mask was not applied)."""
        return bool(self.matcher.accept_token(token))

    @property
    def done(self) -> bool:
        """The grammar took its stop token: nothing may follow."""
        return bool(self.matcher.is_terminated())


def apply_guides(logits: torch.Tensor, guides: list) -> torch.Tensor:
    """`logits` [B, V] with each guided row's disallowed tokens at -inf (a copy; rows whose guide is None, and rows
    past the guides, are unchanged). The bitmask is filled on the host and applied on the logits' device."""
    import xgrammar as xgr

    if len(guides) > logits.shape[0]:
        raise ValueError(f"{len(guides)} guides for {logits.shape[0]} rows of logits")
    mask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[-1])  # all tokens allowed until filled
    for i, g in enumerate(guides):
        if g is not None:
            g.fill(mask, i)
    out = logits.clone()
    xgr.apply_token_bitmask_inplace(out, mask.to(out.device, non_blocking=True))
    return out
