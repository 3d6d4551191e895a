"""DeepSeek-V3's multi-token-prediction (MTP) layer, run as a drafter (speculative.MtpDrafter).

The layer after the model's last (`model.layers.{L}`, L = num_hidden_layers; the DeepSeek-V3 technical report's
MTP module, depth 1). At position t, from the model's last hidden state h_t there (the last layer's output, before
the final norm) and the next token:

    x    = eh_proj([enorm(embed(token[t + 1])), hnorm(h_t)])     (the two concatenated in that order)
    h'_t = DecoderLayer_L(x)                                      (MLA over the MTP layer's own cache, then MoE)
    p    = softmax(head(shared_head.norm(h'_t)))                  (its guess at token[t + 2])

embed is the model's embedding, head `shared_head.head` (the model's lm_head where the checkpoint has none).
Drafting k tokens chains the layer (as vLLM and SGLang do with one MTP layer): h'_t stands in for h_{t+1} and the
draft for token[t + 2] at position t + 1, and so on. vLLM zeroes the embedding at position 0; the report and
SGLang do not, nor does this.

The decoder layer is layer L of `weights.mtp_config` (the model with the MTP layer as one more layer): its plan
ops, run by the torch executor's op implementations over the MTP layer's own cache (one MLA layer's latent cache of
the model's slots and positions).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backends.torch.ops import OP_IMPLS, StepContext
from .cache import cache_bytes, layer_shapes
from .config import ModelConfig
from .plan import build_plan
from .reference.norm import rms_norm
from .step import Step
from .weights import mtp_config, mtp_specs, spec_bytes


def mtp_refusal(cfg: ModelConfig) -> str | None:
    """None when the MTP drafter runs this model, else why not (one line)."""
    if cfg.num_mtp_layers == 0:
        return (f"the MTP drafter needs a model with a multi-token-prediction layer (DeepSeek-V3's "
                f"num_nextn_predict_layers in config.json): this {cfg.family} model has none")
    if cfg.num_mtp_layers > 1:
        return (f"the MTP drafter runs one MTP layer; this model has {cfg.num_mtp_layers} "
                f"(num_nextn_predict_layers)")
    return None


def mtp_bytes(cfg: ModelConfig, dtype: torch.dtype, num_slots: int, max_len: int) -> int:
    """Memory of the MTP layer's weights (its head included) and of its cache, for the fit check."""
    weights = sum(spec_bytes(s, dtype.itemsize) for s in mtp_specs(cfg).values())
    one = mtp_config(cfg)
    return weights + cache_bytes(one, num_slots, max_len, dtype) - cache_bytes(cfg, num_slots, max_len, dtype)


class MtpLayer:
    """The MTP layer of `cfg`'s model over `weights` (its tensors, weights.mtp_specs, with the model's
    `model.embed_tokens.weight`, and the head: its `shared_head.head.weight`, or `head`, the model's lm_head),
    with a cache of `num_slots` sequences x `max_len` positions. `experts_impl`: the routed experts' code
    (backends/torch/ops.py StepContext)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], head: torch.Tensor, num_slots: int,
                 max_len: int, *, experts_impl: str = "reference"):
        why = mtp_refusal(cfg)
        if why:
            raise ValueError(why)
        self.cfg = mtp_config(cfg)
        L = cfg.num_layers
        self.p = f"model.layers.{L}"
        self.ops = tuple(op for op in build_plan(self.cfg).ops if op.layer == L)
        self.w = weights
        self.head = weights.get(f"{self.p}.shared_head.head.weight", head)
        self.embed = weights["model.embed_tokens.weight"]
        name = f"cache.{L}"
        self.cache = {name: tuple(torch.zeros(shape, dtype=dt, device=self.embed.device)
                                  for shape, dt in layer_shapes(self.cfg, num_slots, max_len, self.embed.dtype)[name])}
        self.experts_impl = experts_impl

    @torch.inference_mode()
    def __call__(self, step: Step, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of the layer: `step.tokens` [N] the token after each position (token[t + 1] at t), `prev` [N, D]
        the hidden state at each position (the model's, or this layer's own output when chained). Writes the
        positions' cache entries. Returns (h' [N, D] the layer's output, logits [len(step.logit_rows), V] fp32)."""
        eps = self.cfg.rms_norm_eps
        e = rms_norm(F.embedding(step.tokens, self.embed), self.w[f"{self.p}.enorm.weight"], eps)
        h = rms_norm(prev.to(e.dtype), self.w[f"{self.p}.hnorm.weight"], eps)
        ctx = StepContext(self.cfg, self.w, self.cache, step, self.experts_impl)
        ctx.buf["hidden"] = F.linear(torch.cat((e, h), -1), self.w[f"{self.p}.eh_proj.weight"])
        for op in self.ops:
            OP_IMPLS[op.kind](ctx, op)
        out = ctx.buf["hidden"]
        normed = rms_norm(out[step.logit_rows], self.w[f"{self.p}.shared_head.norm.weight"], eps)
        return out, F.linear(normed, self.head).float()
