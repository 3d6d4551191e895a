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

Every plan op kind has a builder (BUILDERS), so any op can have a validated variant. Options that take a case out
of the easy corner (validate/cases.py picks them per variant):
  cache_len  cache positions per slot (attention): above the kernels' 32-position block, the cache is read in
             several chunks and the split-over-cache merge runs
  slots      "arange" (slot n for token n) or "permuted" (a random permutation of batch + 3 slots: the cache has
             slots no token uses, and slot indirection is exercised; Step.contiguous_slots False)
  magnitude  None, "tiny" (every third row of the main activation scaled by 1e-3: eps placement and precision
             at small norms) or "large" (every third row, offset by one, scaled by 4096: squares overflow fp16,
             a 16-bit sum of squares shows); for the norm and residual ops and KDA (MAGNITUDE_KINDS). KDA's
             l2norm sees q and k, made of this token's activation and the conv state's previous tokens, and its
             gated norm sees the recurrent state's readout: the scaled rows' slots have both states scaled too
  sources    ATTN_RES: run the op over this many sources (closed blocks + partial sum) instead of the preset's
             most complete op (a config with enough layers: validate/cases.py)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from .. import plan as P
from ..cache import FP32_PARTS
from ..config import ModelConfig
from ..backends.torch.ops import StepContext
from ..reference.routing import route
from ..step import Step
from ..weights import param_specs, random_tensor

DISTRIBUTIONS = ("uniform", "hot_expert", "same_experts", "exact_ties", "empty_experts")
ROUTED = (P.ROUTER, P.EXPERTS, P.LATENT_MOE)  # op kinds the routing distribution applies to
ATTENTION = (P.ATTN_GQA, P.ATTN_MLA, P.ATTN_KDA)  # op kinds with a cache (slots apply)
MAGNITUDE_KINDS = (P.RMSNORM, P.ADD, P.ADD_RMSNORM, P.ATTN_RES, P.ATTN_KDA)  # op kinds the magnitude cases apply to
MAGNITUDES = {"tiny": 1e-3, "large": 4096.0}
CACHE_LEN = 16  # cache positions per slot in attention cases (the default: below one 32-position block)
EXTRA_SLOTS = 3  # slots no token of a permuted-slots case uses
FP32_BUFFERS = ("topk_weights",)  # activations in fp32 whatever the model dtype
TOKEN_DIM = {"blocks": 1}  # buffers whose token index is not the first: AttnRes's closed blocks [n, T, D]


def token_rows(name: str, t: torch.Tensor, i: int) -> torch.Tensor:
    """Token i's part of buffer `name` (a view keeping the token dimension)."""
    return t.narrow(TOKEN_DIM.get(name, 0), i, 1)


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
        inputs = {k: token_rows(k, v, i).clone() if v.dim() > TOKEN_DIM.get(k, 0)
                  and v.shape[TOKEN_DIM.get(k, 0)] == T else v.clone() for k, v in self.inputs.items()}
        s = self.step
        step = Step(tokens=s.tokens[i:i + 1], positions=s.positions[i:i + 1], slots=s.slots[i:i + 1],
                    logit_rows=torch.zeros(1, dtype=torch.int64), kv_len=int(s.positions[i]) + 1)
        if "positions" in inputs:
            inputs["positions"], inputs["slots"] = step.positions, step.slots
        return replace(self, inputs=inputs, step=step,
                       cache=None if self.cache is None else tuple(c.clone() for c in self.cache))


def closed_blocks(cfg: ModelConfig, op: P.Op) -> int:
    """How many closed blocks an ATTN_RES op sees once it has run: one per block start up to its layer (the
    final norm's op, layer -1: every block start of the model)."""
    B = cfg.attn_res_block_size
    return (cfg.num_layers - 1) // B if op.layer < 0 else op.layer // B


def attn_res_sources(cfg: ModelConfig, op: P.Op) -> int:
    """How many sources an ATTN_RES op's softmax runs over: the closed blocks, and the partial sum unless the op
    has just closed it (reference/attn_res.py)."""
    return closed_blocks(cfg, op) + ("blocks" not in op.outputs)


def first_op(cfg: ModelConfig, kind: str, sources: int | None = None) -> P.Op:
    """The op of `kind` a case runs: the plan's first; for ATTN_RES the one with the most buffers (it reads the
    closed blocks and closes one more: every output the kind has), among those over `sources` sources if given."""
    plan = P.build_plan(cfg)
    if kind == P.ADD_RMSNORM:  # a composite: it exists in the rewritten plan only
        plan = P.fuse_add_rmsnorm(plan)
    ops = [op for op in plan.ops if op.kind == kind]
    if sources is not None:
        if kind != P.ATTN_RES:
            raise ValueError(f"sources apply to {P.ATTN_RES!r} ops, not {kind!r}")
        ops = [op for op in ops if attn_res_sources(cfg, op) == sources]
    if not ops:
        raise ValueError(f"the {cfg.family} plan ({cfg.num_layers} layers) has no {kind!r} op"
                         + ("" if sources is None else f" over {sources} sources"))
    if kind == P.ATTN_RES:
        return max(ops, key=lambda op: len(op.inputs) + len(op.outputs))
    return ops[0]


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


def magnitude_rows(T: int, magnitude: str | None) -> torch.Tensor:
    """The token rows a magnitude case scales: every third (rows 0, 3, ... tiny; rows 1, 4, ... large)."""
    if magnitude is None:
        return torch.zeros(0, dtype=torch.int64)
    return torch.arange(0 if magnitude == "tiny" else 1, T, 3)


def _scale_rows(x: torch.Tensor, magnitude: str | None) -> torch.Tensor:
    """x with magnitude_rows scaled by MAGNITUDES[magnitude]."""
    if magnitude is None:
        return x
    x = x.clone()
    x[magnitude_rows(x.shape[0], magnitude)] *= MAGNITUDES[magnitude]
    return x


def build_case(cfg: ModelConfig, kind: str, batch: int, seed: int, dist: str = "uniform", device="cpu", *,
               cache_len: int = CACHE_LEN, slots: str = "arange", magnitude: str | None = None,
               sources: int | None = None) -> OpCase:
    """An fp32 case; `OpCase.clone(dtype)` rounds it to the dtype under test. Options: module doc."""
    if kind not in BUILDERS:
        raise ValueError(f"no input builder for op kind {kind!r}")
    if slots not in ("arange", "permuted"):
        raise ValueError(f"slots must be 'arange' or 'permuted', got {slots!r}")
    if magnitude is not None and magnitude not in MAGNITUDES:
        raise ValueError(f"magnitude must be None or one of {sorted(MAGNITUDES)}, got {magnitude!r}")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + batch)
    op = first_op(cfg, kind, sources)
    specs = param_specs(cfg)
    weights = {n: random_tensor(specs[n], gen, "cpu", torch.float32) for n in op.weights}
    T = batch
    x = torch.randn(T, cfg.hidden_size, generator=gen) * 1.5 + 0.1
    if slots == "permuted":
        order = torch.randperm(T + EXTRA_SLOTS, generator=gen)[:T]
        step = Step(tokens=torch.zeros(T, dtype=torch.int64), positions=torch.zeros(T, dtype=torch.int64),
                    slots=order, logit_rows=torch.arange(T), kv_len=1, contiguous_slots=False)
    else:
        step = Step(tokens=torch.zeros(T, dtype=torch.int64), positions=torch.zeros(T, dtype=torch.int64),
                    slots=torch.arange(T), logit_rows=torch.arange(T), kv_len=1, contiguous_slots=True)
    b = _Build(cfg, op, kind, weights, x, step, gen, dist, cache_len, magnitude,
               T + (EXTRA_SLOTS if slots == "permuted" else 0))
    BUILDERS[kind](b)
    case = OpCase(cfg, op, b.inputs, b.weights, b.step, b.cache)
    return case if torch.device(device).type == "cpu" else _to(case, device)


@dataclass
class _Build:
    """What a builder reads (the op, its random weights, a random activation x, the step, the generator, the
    options) and fills (inputs, possibly weights, step and cache)."""

    cfg: ModelConfig
    op: P.Op
    kind: str
    weights: dict
    x: torch.Tensor
    step: Step
    gen: torch.Generator
    dist: str
    cache_len: int
    magnitude: str | None
    num_slots: int
    inputs: dict = field(default_factory=dict)
    cache: tuple | None = None


def _routed(b: _Build) -> None:
    x, W, bias = _router_rows(b.cfg, b.dist, b.x, b.gen)
    if b.kind == P.ROUTER:
        b.weights[b.op.weights[0]] = W
        if len(b.op.weights) > 1:
            b.weights[b.op.weights[1]] = bias
        b.inputs["normed"] = x
    else:
        ids, wts = route(b.cfg, x, W, bias if b.cfg.score_func == "sigmoid" else None)
        b.inputs.update(normed=x, topk_ids=ids, topk_weights=wts)


def _one_input(b: _Build) -> None:  # RMSNORM ("hidden"; K3 normalizes "layer_in"), LM_HEAD ("final"), MLP
    b.inputs[b.op.inputs[0]] = _scale_rows(b.x, b.magnitude)
    if len(b.op.inputs) == 2:  # the final norm: the rows whose logits are wanted
        b.inputs[b.op.inputs[1]] = b.step.logit_rows


def _two_inputs(b: _Build) -> None:  # ADD, ADD_RMSNORM: the residual stream and an op's output
    b.inputs[b.op.inputs[0]] = _scale_rows(b.x, b.magnitude)
    b.inputs[b.op.inputs[1]] = torch.randn(b.x.shape, generator=b.gen) * 0.5


def _embed(b: _Build) -> None:
    tokens = torch.randint(0, b.cfg.vocab_size, (b.x.shape[0],), generator=b.gen)
    b.step = replace(b.step, tokens=tokens)
    b.inputs[b.op.inputs[0]] = tokens


def _attn_res(b: _Build) -> None:
    """The layer's partial sum `hidden` and, where the op reads them, the closed blocks' sums."""
    b.inputs["hidden"] = _scale_rows(b.x, b.magnitude)
    if "blocks" in b.op.inputs:
        n = closed_blocks(b.cfg, b.op) - ("blocks" in b.op.outputs)
        b.inputs["blocks"] = torch.randn((n,) + tuple(b.x.shape), generator=b.gen) * 1.5


def _attention(b: _Build) -> None:
    T, L = b.x.shape[0], b.cache_len
    positions = torch.randint(0, L, (T,), generator=b.gen)
    positions[0] = L - 1  # one sequence at the end of its cache
    b.step = replace(b.step, positions=positions, kv_len=int(positions.max()) + 1)
    b.inputs.update(normed=b.x, positions=positions, slots=b.step.slots)
    b.cache = tuple(torch.randn((b.num_slots, L) + c.shape[2:], generator=b.gen) for c in _cache_like(b.cfg))


def _kda(b: _Build) -> None:
    """A decode step of T sequences with some history: random conv windows and states in every slot."""
    H, K, W = b.cfg.linear_num_heads, b.cfg.linear_head_dim, b.cfg.conv_kernel
    b.inputs.update(normed=_scale_rows(b.x, b.magnitude), slots=b.step.slots)
    conv = torch.randn(b.num_slots, 3 * H * K, W - 1, generator=b.gen)
    rec = torch.randn(b.num_slots, H, K, K, generator=b.gen) * K ** -0.5
    if b.magnitude is not None:  # the scaled tokens' histories too: q and k of tiny (large) norm, as is o
        slots = b.step.slots[magnitude_rows(b.x.shape[0], b.magnitude)]
        conv[slots] *= MAGNITUDES[b.magnitude]
        rec[slots] *= MAGNITUDES[b.magnitude]
    b.cache = (conv, rec)


BUILDERS = {P.ROUTER: _routed, P.EXPERTS: _routed, P.LATENT_MOE: _routed, P.RMSNORM: _one_input,
            P.LM_HEAD: _one_input, P.MLP: _one_input, P.ADD: _two_inputs, P.ADD_RMSNORM: _two_inputs,
            P.EMBED: _embed, P.ATTN_RES: _attn_res, P.ATTN_GQA: _attention, P.ATTN_MLA: _attention,
            P.ATTN_KDA: _kda}


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


def reference_outputs(case: OpCase, dtype: torch.dtype = torch.float32,
                      side: tuple[str, ...] = ()) -> tuple[dict[str, torch.Tensor], tuple | None]:
    """The torch reference op (backends/torch/ops.py) on the case, computed in `dtype`: fp32 (the target the
    harness compares with) or the dtype under test (what the same computation errs by in it: tolerances.py).
    Buffers the model keeps in fp32 whatever its dtype stay fp32. `side`: side outputs to add (contract
    SIDE_OUTPUTS: LM_HEAD's greedy tokens and logprobs). Returns (outputs, cache after)."""
    from ..contract import side_output_reference

    from ..backends.torch.ops import OP_IMPLS

    c = case.clone(dtype)
    step = replace(c.step, positions=c.inputs.get("positions", c.step.positions),
                   slots=c.inputs.get("slots", c.step.slots))
    ctx = StepContext(c.cfg, c.weights, {c.op.cache: c.cache} if c.op.cache else {}, step)
    ctx.buf.update(c.inputs)
    OP_IMPLS[c.op.kind](ctx, c.op)
    outs = {n: ctx.buf[n] for n in c.op.outputs}
    return {**outs, **side_output_reference(c.op.kind, outs, side)}, c.cache
