"""Shared pieces of the transformers parity tests: the prompts, the error measure, loading the oracle
from a checkpoint directory and running it teacher-forced with its own KV cache."""

from __future__ import annotations

import torch

# Ragged on purpose: the engine runs them as one batch, the oracle one at a time (no padding involved).
PROMPTS = [[256, 72, 101, 108, 108, 111], [256, 7], [256, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [256, 40, 41]]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, in fp64."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def load_oracle(ckpt):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(ckpt), dtype=torch.float32, attn_implementation="eager", experts_implementation="eager").eval()


def hf_teacher_forced(hf, prompt: list[int], continuation: list[int]) -> list[torch.Tensor]:
    """The oracle's next-token logits after the prompt, then after each continuation token."""
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        logits, past = [out.logits[0, -1]], out.past_key_values
        for t in continuation:
            out = hf(torch.tensor([[t]]), past_key_values=past, use_cache=True)
            logits.append(out.logits[0, -1])
            past = out.past_key_values
    return logits


def hf_greedy(hf, prompt: list[int], steps: int) -> list[int]:
    """The oracle's greedy continuation of exactly `steps` tokens (EOS ignored)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=steps, min_new_tokens=steps,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
