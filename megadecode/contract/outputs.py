"""The shape and dtype of every op's outputs, as the reference op produces them: what an executor
preallocates (and poisons) before it hands the outputs to a variant."""

from __future__ import annotations

import torch

from .. import plan as P
from ..config import ModelConfig

# Poison written into outputs before a variant runs: a value left there means "not written". Floats are poisoned
# with a quiet NaN of a specific payload (bit pattern), not the canonical NaN, so that an element still holding the
# poison ("not written") is told apart from a NaN the variant computed ("produced a non-finite value"): arithmetic
# on the CPU and on NVIDIA GPUs yields the canonical NaN (0x7FC00000 / 0x7FFFFFFF for fp32) or propagates the
# payload of a NaN input, and the harness's inputs hold no NaN. The comparison is bitwise. Integers: their minimum.
POISON_BITS = {torch.float32: (torch.int32, 0x7FDADADA), torch.float16: (torch.int16, 0x7E5A),
               torch.bfloat16: (torch.int16, 0x7FDA), torch.float64: (torch.int64, 0x7FFDADADADADADAD)}
POISON_INT = torch.iinfo(torch.int64).min


def output_specs(cfg: ModelConfig, op: P.Op, buf: dict[str, torch.Tensor],
                 weights: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    x = buf[op.inputs[0]]
    D, A = cfg.hidden_size, cfg.top_k
    if op.kind == P.EMBED:
        return {op.outputs[0]: ((x.shape[0], D), weights[op.weights[0]].dtype)}
    if op.kind == P.RMSNORM:
        rows = buf[op.inputs[1]].shape[0] if len(op.inputs) == 2 else x.shape[0]
        return {op.outputs[0]: ((rows, x.shape[1]), x.dtype)}
    if op.kind == P.ADD:
        return {op.outputs[0]: (tuple(x.shape), torch.promote_types(x.dtype, buf[op.inputs[1]].dtype))}
    if op.kind == P.ADD_RMSNORM:
        dt = torch.promote_types(x.dtype, buf[op.inputs[1]].dtype)
        return {op.outputs[0]: (tuple(x.shape), dt), op.outputs[1]: (tuple(x.shape), dt)}
    if op.kind == P.ATTN_RES:  # kimi_k3; at a block's first layer it also closes the previous block
        out = {"layer_in": ((x.shape[0], D), x.dtype)}
        if "blocks" in op.outputs:
            n = (buf["blocks"].shape[0] if "blocks" in op.inputs else 0) + 1
            out.update(blocks=((n, x.shape[0], D), x.dtype), hidden=((x.shape[0], D), x.dtype))
        return out
    if op.kind in (P.ATTN_GQA, P.ATTN_MLA, P.ATTN_KDA, P.EXPERTS, P.LATENT_MOE, P.MLP):
        return {op.outputs[0]: ((x.shape[0], D), x.dtype)}
    if op.kind == P.ROUTER:
        return {"topk_ids": ((x.shape[0], A), torch.int64), "topk_weights": ((x.shape[0], A), torch.float32)}
    if op.kind == P.LM_HEAD:
        return {op.outputs[0]: ((x.shape[0], cfg.vocab_size), torch.float32)}
    raise ValueError(f"no output spec for op kind {op.kind!r}")


# Outputs an op kind's variants may write besides the op's (Manifest.side_outputs), what the reference computes
# for them from the op's outputs, and their shapes: LM_HEAD's greedy next token per row (the lowest index among
# equal maxima, as torch.argmax) and its log-probability at temperature 1 (sampling.sample).
SIDE_OUTPUTS: dict[str, tuple[str, ...]] = {P.LM_HEAD: ("tokens", "logprobs")}


def side_output_specs(op: P.Op, buf: dict[str, torch.Tensor], names) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of the side outputs `names` of `op` (SIDE_OUTPUTS); ValueError for one its kind lacks."""
    unknown = set(names) - set(SIDE_OUTPUTS.get(op.kind, ()))
    if unknown:
        raise ValueError(f"no side output {sorted(unknown)} for op kind {op.kind!r} (SIDE_OUTPUTS)")
    rows = buf[op.inputs[0]].shape[0]
    specs = {"tokens": ((rows,), torch.int64), "logprobs": ((rows,), torch.float32)}
    return {n: specs[n] for n in names}


def side_output_reference(kind: str, outputs: dict[str, torch.Tensor], names) -> dict[str, torch.Tensor]:
    """The side outputs `names` from the reference op's outputs (LM_HEAD: greedy sampling of its logits)."""
    if not names:
        return {}
    from ..sampling import SamplingParams, sample

    tokens, logprobs = sample(outputs["logits"].float(), SamplingParams(greedy=True))
    return {n: {"tokens": tokens, "logprobs": logprobs}[n] for n in names}


def _poison_value(dtype: torch.dtype):
    """(dtype the poison is written as, the value in that dtype)."""
    if dtype in POISON_BITS:
        return POISON_BITS[dtype]
    if dtype.is_floating_point:
        raise ValueError(f"no poison bit pattern for {dtype}")
    return dtype, (torch.iinfo(dtype).min if dtype != torch.bool else True)


def poisoned(shape, dtype, device) -> torch.Tensor:
    """A tensor of `shape` and `dtype` holding the poison in every element."""
    as_dtype, value = _poison_value(dtype)
    return torch.full(shape, value, dtype=as_dtype, device=device).view(dtype)


def poison_mask(t: torch.Tensor) -> torch.Tensor:
    """True where an element holds the poison, bit for bit."""
    as_dtype, value = _poison_value(t.dtype)
    return (t.view(as_dtype) if as_dtype != t.dtype else t) == value


def unwritten(t: torch.Tensor) -> int:
    """How many elements still hold the poison (bitwise: a NaN the variant computed does not count)."""
    return int(poison_mask(t).sum())


def nonfinite(t: torch.Tensor) -> int:
    """How many elements are NaN or infinite without being the poison: values the variant produced."""
    if not t.is_floating_point():
        return 0
    return int((~torch.isfinite(t) & ~poison_mask(t)).sum())
