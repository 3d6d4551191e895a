"""Shared pieces of the transformers parity tests: the prompts, the error measure, loading the oracle
from a checkpoint directory and running it teacher-forced with its own KV cache, writing a checkpoint with
transformers' own save_pretrained and re-laying its tensors out."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# preset -> the prefix of its transformers classes (<prefix>Config, <prefix>ForCausalLM)
CLASSES = {"tiny-qwen3-moe": "Qwen3Moe", "tiny-deepseek-v3": "DeepseekV3", "tiny-kimi-linear": "KimiLinear"}

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


def save_with_transformers(preset: str, out: Path, original: bool = True, seed: int = 5) -> Path:
    """A tiny model of the family built by transformers, with our random weights (random_weights(seed): clear
    routing margins, no near-ties), written by its save_pretrained (original=False: transformers' own names)."""
    import transformers

    from megadecode.presets import preset_config, preset_hf_config
    from megadecode.weights import random_weights

    d = preset_hf_config(preset)
    prefix = CLASSES[preset]
    model = getattr(transformers, f"{prefix}ForCausalLM")(
        getattr(transformers, f"{prefix}Config")(**{k: v for k, v in d.items() if k != "model_type"}))
    model.load_state_dict(random_weights(preset_config(preset), seed=seed), strict=True)
    model.save_pretrained(out, save_original_format=original)
    return out


def relayout(src: Path, dst: Path, fn, config: dict | None = None) -> Path:
    """A single-file copy of checkpoint `src` with its tensors renamed / split by fn(dict) -> dict (and `config`
    as its config.json, when given)."""
    import json

    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(config) if config is not None else (src / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in fn(tensors).items()}, str(dst / "model.safetensors"))
    return dst
