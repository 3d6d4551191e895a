"""The shape and dtype of every op's outputs, as the reference op produces them: what an executor
preallocates (and poisons) before it hands the outputs to a variant."""

from __future__ import annotations

import torch

from .. import plan as P
from ..config import ModelConfig

# Poison written into outputs before a variant runs: a value left there means "not written".
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


def poisoned(shape, dtype, device) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    return t.fill_(float("nan") if dtype.is_floating_point else POISON_INT)


def unwritten(t: torch.Tensor) -> int:
    """How many elements still hold the poison."""
    return int((t.isnan() if t.dtype.is_floating_point else t == POISON_INT).sum())
