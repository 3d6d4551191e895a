"""Fresh random inputs for one plan op: the op (taken from the model's plan, so buffer and weight names
are the real ones), its input buffers, weights, cache and step.

Routing distributions (router and experts ops; the experts op gets the reference router's picks):
  uniform        random hidden states and router rows
  hot_expert     one expert takes most tokens: hidden states share a direction its router row points to
  same_experts   every token identical, so every token picks the same experts
  exact_ties     small-integer hidden states and router rows, rows repeated in triples (and, with expert
                 groups, the upper half of the groups a copy of the lower half): scores tie exactly in any
                 summation order, and ties straddle the top-k and top-group boundaries
  empty_experts  the upper half of the experts point away from every token: they get none (at batch 1
                 most experts are empty anyway)
Hidden states are never zeros; caches are filled with random values (a stale entry is then visible).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from .. import plan as P
from ..cache import FP32_PARTS
from ..config import ModelConfig
from ..executors.torch_ops import StepContext
from ..reference.routing import route
from ..step import Step
from ..weights import param_specs, random_tensor

DISTRIBUTIONS = ("uniform", "hot_expert", "same_experts", "exact_ties", "empty_experts")
ROUTED = (P.ROUTER, P.EXPERTS, P.LATENT_MOE)  # op kinds the routing distribution applies to
CACHE_LEN = 16  # cache positions per slot in attention cases
FP32_BUFFERS = ("topk_weights",)  # activations in fp32 whatever the model dtype


@dataclass
class OpCase:
    cfg: ModelConfig
    op: P.Op
    inputs: dict[str, torch.Tensor]
    weights: dict[str, torch.Tensor]
    step: Step
    cache: tuple[torch.Tensor, ...] | None = None

    @property
    def batch(self) -> int:
        return self.inputs[self.op.inputs[0]].shape[0]

    def clone(self, dtype: torch.dtype | None = None) -> "OpCase":
        """A deep copy, floating tensors cast to `dtype`; buffers the model keeps in fp32 whatever its
        dtype (the router's topk_weights, the selection bias) stay fp32, quantized weights (FP8 values and
        scales, MXFP4 bytes) as they are."""
        fp32_weights = {n for n, s in param_specs(self.cfg).items() if s.fp32 or s.quant}

        def cast(t, keep_fp32=False):
            if dtype is None or not t.is_floating_point() or keep_fp32:
                return t.clone()
            return t.to(dtype).clone()
        fp32_cache = FP32_PARTS.get(self.op.kind, ())  # parts the cache keeps fp32 (cache.py: KDA's state)
        return replace(self, inputs={k: cast(v, k in FP32_BUFFERS) for k, v in self.inputs.items()},
                       weights={k: cast(v, k in fp32_weights) for k, v in self.weights.items()},
                       cache=None if self.cache is None else tuple(cast(c, j in fp32_cache)
                                                                   for j, c in enumerate(self.cache)))

    def row(self, i: int) -> "OpCase":
        """Token i alone (batch invariance). Attention keeps the whole cache and reads slot i."""
        T = self.batch
        inputs = {k: v[i:i + 1].clone() if v.dim() and v.shape[0] == T else v.clone() for k, v in self.inputs.items()}
        s = self.step
        step = Step(tokens=s.tokens[i:i + 1], positions=s.positions[i:i + 1], slots=s.slots[i:i + 1],
                    logit_rows=torch.zeros(1, dtype=torch.int64), kv_len=int(s.positions[i]) + 1)
        if "positions" in inputs:
            inputs["positions"], inputs["slots"] = step.positions, step.slots
        return replace(self, inputs=inputs, step=step,
                       cache=None if self.cache is None else tuple(c.clone() for c in self.cache))


def first_op(cfg: ModelConfig, kind: str) -> P.Op:
    plan = P.build_plan(cfg)
    if kind == P.ADD_RMSNORM:  # a composite: it exists in the rewritten plan only
        plan = P.fuse_add_rmsnorm(plan)
    for op in plan.ops:
        if op.kind == kind:
            return op
    raise ValueError(f"the {cfg.family} plan has no {kind!r} op")


def _router_rows(cfg: ModelConfig, dist: str, x: torch.Tensor, gen: torch.Generator):
    """(hidden states, router weight [E, D], selection bias [E] fp32) for a routing distribution."""
    T, D = x.shape
    E = cfg.num_experts
    W = torch.randn(E, D, generator=gen) / math.sqrt(D)
    bias = torch.randn(E, generator=gen) * 0.1
    u = torch.randn(D, generator=gen)
    u = u / u.norm()
    if dist == "hot_expert":
        hot = int(torch.randint(E, (1,), generator=gen))
        x = x + 3 * u
        W[hot] = 2 * u
        bias[hot] += 0.5
    elif dist == "same_experts":
        x = x[:1].expand(T, D).clone()
    elif dist == "empty_experts":
        x = x + 3 * u
        W[E // 2:] = W[E // 2:] * 0.1 - 2 * u
    elif dist == "exact_ties":
        x = torch.randint(-4, 5, (T, D), generator=gen).float() / 4
        base_w = torch.randint(-2, 3, (E, D), generator=gen).float() / 8
        base_b = torch.randint(-4, 5, (E,), generator=gen).float() / 64
        e = torch.arange(E)
        if cfg.n_group > 1 and cfg.n_group % 2 == 0:
            e = e % (E // 2)  # the upper half of the groups copies the lower half: group scores tie
        rows = e // 3
        W, bias = base_w[rows], base_b[rows]
    elif dist != "uniform":
        raise ValueError(f"unknown routing distribution {dist!r}; choose from {DISTRIBUTIONS}")
    return x, W, bias


def build_case(cfg: ModelConfig, kind: str, batch: int, seed: int, dist: str = "uniform",
               device="cpu") -> OpCase:
    """An fp32 case; `OpCase.clone(dtype)` rounds it to the dtype under test."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + batch)
    op = first_op(cfg, kind)
    specs = param_specs(cfg)
    weights = {n: random_tensor(specs[n], gen, "cpu", torch.float32) for n in op.weights}
    T, D = batch, cfg.hidden_size
    x = torch.randn(T, D, generator=gen) * 1.5 + 0.1
    step = Step(tokens=torch.zeros(T, dtype=torch.int64), positions=torch.zeros(T, dtype=torch.int64),
                slots=torch.arange(T), logit_rows=torch.arange(T), kv_len=1, contiguous_slots=True)
    inputs: dict[str, torch.Tensor] = {}
    cache = None
    if kind in ROUTED:
        x, W, bias = _router_rows(cfg, dist, x, gen)
        if kind == P.ROUTER:
            weights[op.weights[0]] = W
            if len(op.weights) > 1:
                weights[op.weights[1]] = bias
            inputs["normed"] = x
        else:
            ids, wts = route(cfg, x, W, bias if cfg.score_func == "sigmoid" else None)
            inputs.update(normed=x, topk_ids=ids, topk_weights=wts)
    elif kind == P.RMSNORM:
        inputs[op.inputs[0]] = x  # "hidden"; K3 (AttnRes) normalizes "layer_in"
    elif kind == P.LM_HEAD:
        inputs[op.inputs[0]] = x  # "final": the normed rows whose logits are wanted
    elif kind == P.ADD_RMSNORM:  # the residual stream and an op's output, of different sizes
        inputs[op.inputs[0]] = x
        inputs[op.inputs[1]] = torch.randn(T, D, generator=gen) * 0.5
    elif kind in (P.ATTN_GQA, P.ATTN_MLA):
        positions = torch.randint(0, CACHE_LEN, (T,), generator=gen)
        positions[0] = CACHE_LEN - 1  # one sequence at the end of its cache
        step = replace(step, positions=positions, kv_len=int(positions.max()) + 1)
        inputs.update(normed=x, positions=positions, slots=step.slots)
        cache = tuple(torch.randn((T, CACHE_LEN) + c.shape[2:], generator=gen)
                      for c in _cache_like(cfg))
    elif kind == P.ATTN_KDA:
        # a decode step of T sequences in slots 0..T-1 with some history: random conv windows and states
        H, K, W = cfg.linear_num_heads, cfg.linear_head_dim, cfg.conv_kernel
        inputs.update(normed=x, slots=step.slots)
        cache = (torch.randn(T, 3 * H * K, W - 1, generator=gen),
                 torch.randn(T, H, K, K, generator=gen) * K ** -0.5)
    else:
        raise ValueError(f"no input builder for op kind {kind!r}")
    case = OpCase(cfg, op, inputs, weights, step, cache)
    return case if torch.device(device).type == "cpu" else _to(case, device)


def _cache_like(cfg: ModelConfig):
    if cfg.is_mla:
        return (torch.empty(1, 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim),)
    return (torch.empty(1, 1, cfg.num_kv_heads, cfg.head_dim),) * 2


def _to(case: OpCase, device) -> OpCase:
    mv = lambda d: {k: v.to(device) for k, v in d.items()}  # noqa: E731
    s = case.step
    step = replace(s, tokens=s.tokens.to(device), positions=s.positions.to(device), slots=s.slots.to(device),
                   logit_rows=s.logit_rows.to(device))
    return replace(case, inputs=mv(case.inputs), weights=mv(case.weights), step=step,
                   cache=None if case.cache is None else tuple(c.to(device) for c in case.cache))


def reference_outputs(case: OpCase) -> tuple[dict[str, torch.Tensor], tuple | None]:
    """The torch reference op (executors/torch_ops.py) on the case, in fp32. Returns (outputs, cache after)."""
    from ..executors.torch_ops import OP_IMPLS

    def up(v):  # quantized weights (FP8 values, MXFP4 bytes) stay as they are
        return v.float() if v.dtype in (torch.float16, torch.bfloat16) else v

    c = case.clone(torch.float32)
    c = replace(c, inputs={k: up(v) for k, v in c.inputs.items()}, weights={k: up(v) for k, v in c.weights.items()},
                cache=None if c.cache is None else tuple(t.float() for t in c.cache))
    step = replace(c.step, positions=c.inputs.get("positions", c.step.positions),
                   slots=c.inputs.get("slots", c.step.slots))
    ctx = StepContext(c.cfg, c.weights, {c.op.cache: c.cache} if c.op.cache else {}, step)
    ctx.buf.update(c.inputs)
    OP_IMPLS[c.op.kind](ctx, c.op)
    return {n: ctx.buf[n] for n in c.op.outputs}, c.cache
