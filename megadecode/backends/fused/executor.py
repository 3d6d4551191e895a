"""The `fused` executor: the graph executor's decode step with plan ops replaced by the registered Triton
variants (megadecode.backends.fused.kernels.catalog), captured in a CUDA graph (issue 5, item 3).

Which variants, in order of preference per op kind (the first whose manifest scope admits the model,
dtype, batch and device runs the op; every other op runs the graph executor's op, sync-free):
  The plan is first rewritten by plan.fuse_add_rmsnorm: each residual ADD followed by an RMSNORM of its sum
  becomes one ADD_RMSNORM op (reference: the two ops in turn).
  rmsnorm  triton-rmsnorm            (one kernel instead of the reference's chain of elementwise ops)
  add_rmsnorm triton-add-rmsnorm     (the residual add and the norm after it in one kernel)
  router   triton-router             (logits on tensor cores over expert tiles and K chunks, then one selection
                                      kernel that adds the chunks)
  experts  triton-grouped-experts    (batch <= 256, tensor cores: per pair at <= 16 tokens, no sort pass;
                                      grouped by expert on the device above)
           triton-fused-experts      (batch <= 16, FMA: the fallback where the first is out of scope)
           triton-fp8-experts        (FP8 experts: values decoded in registers, tensor cores, batch <= 256; the
                                      two above refuse FP8)
  latent_moe cute-latent-moe       (K3 on the H200: the routed MXFP4 experts in CuTe DSL on tensor cores,
                                      weights re-laid out once in fragment order; latent dims multiples of 256.
                                      Where it is in scope the executor holds the experts in that order only
                                      (backends/expert_layout.py), so it also runs prefill's LATENT_MOE ops and
                                      batches past 256, 256 tokens a call)
             triton-latent-moe       (K3: latent down, routed MXFP4 experts, RMSNorm fused into latent up;
                                      batch <= 256; above, the graph op, whose experts are Triton too)
  mlp      triton-mlp                (SwiGLU MLP: gate and up as one projection, packed one after the other at
                                      build (backends/fused/kernels/packed.py), the SiLU product, down: three launches)
  attn_res triton-attn-res           (K3's Block AttnRes in one kernel a token: scores, softmax over the
                                      sources and their weighted sum, without concatenating the sources)
  attn_kda triton-kda-fused          (KDA decode in three launches: the six input projections as one, packed
                                      one after another at build (backends/fused/kernels/packed.pack_rows); conv, gates,
                                      recurrence and gated norm in one kernel per (sequence, head); o_proj)
           triton-kda-decode         (the KDA decode recurrence in one kernel: one read and one write of each
                                      sequence's state; the rest of the op stays the reference ops)
  attn_mla triton-mla-decode         (MLA decode attention over the latent cache, split over the cache length:
                                      programs (sequence, head block, chunk), online softmax, fixed-order merge;
                                      projections stay the reference ops)
  attn_gqa triton-gqa-decode         (GQA decode attention: q/k norms, RoPE and cache write in one kernel, then
                                      the split attention and its merge; q/k/v/o projections stay torch)
H200 harness reports for each: docs/evidence/<variant>-h200.md. Variants run on outputs allocated with torch.empty: the manifest
checks (poisoning, write watch) are the harness's job (megadecode.validate.executor.VariantExecutor), not serving's.
Scope decisions are made once per captured batch; `chosen` records them per op kind. When both attention kernels
are in scope (`length_free`) one graph per batch size serves every cache length: the kernels read the positions
from device memory, and the host's kv_len is the cache's length, which only sizes the split.

Expert parallelism (`parallel`): the EXPERTS and LATENT_MOE variants run over this rank's experts and their fp32
partial sums are combined over the ranks (backends/fused/parallel_moe.py; fragment-ordered K3 experts: `_latent_frag`);
an lm_head split by rows (parallel/vocab.py) runs torch_ops' LM_HEAD, its rows and the logits' all-gather; every
other op is replicated, unchanged.

Sampling in the step (`set_sampling`; not with an lm_head split by rows): for greedy or temperature sampling
(top_p == 1) the LM_HEAD op runs
backends/fused/kernels/lm_head.py's lm_head_sample instead of F.linear, so the captured step also returns the next tokens and
their logprobs (`sampled`), with the noise seed read from a device tensor (`seed`) that the caller rewrites
before each step. Engine.generate uses it when the executor offers it; top-p keeps sampling.sample.
"""

from __future__ import annotations

import os
import sys

import torch

from ...cache import KVCache
from ...contract import output_specs
from ...plan import ATTN_GQA, ATTN_KDA, ATTN_MLA, LATENT_MOE, LM_HEAD, MLP, DecodePlan, fuse_add_rmsnorm
from ...step import Step
from .. import expert_layout
from . import parallel_moe
from ..graph.executor import GraphExecutor
from ..torch.ops import OP_IMPLS, StepContext

# lm_head_sample streams the lm_head weight once per 64 tokens, so above 64 it reads it several times (not
# measured there; bench/lm_head_paths.py on the H200, batch 64 in tiles of 16 tokens = 4 reads: 2.15 ms for
# K3's lm_head against 0.72 ms for cuBLAS + sampling.sample): larger batches keep sampling.sample
SAMPLE_IN_STEP_MAX_BATCH = 64

# attention ops whose reference reads the cache up to the host's kv_len (FusedExecutor.length_free)
LENGTH_OPS = (ATTN_GQA, ATTN_MLA)

VARIANTS = ("triton-rmsnorm", "triton-add-rmsnorm", "triton-router", "triton-grouped-experts", "triton-fused-experts",
            "triton-fp8-experts", "cute-latent-moe", "triton-latent-moe", "triton-mlp", "triton-attn-res",
            "triton-kda-fused", "triton-kda-decode", "triton-mla-decode", "triton-gqa-decode")


def _variants(device: torch.device) -> list:
    """The shipped variants of VARIANTS (megadecode.backends.fused.kernels.catalog). On the CPU only under the Triton
    interpreter (the kernels must have been decorated with TRITON_INTERPRET=1)."""
    from .kernels import require_triton

    require_triton("the fused executor")
    if device.type == "cpu" and "megadecode.backends.fused.kernels.fused_experts" not in sys.modules \
            and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the fused executor runs Triton kernels: on the CPU set TRITON_INTERPRET=1 before "
                         "megadecode.backends.fused.kernels is first imported (tiny models, fp32/fp16 only), or use a CUDA GPU")
    from .kernels.catalog import shipped

    return shipped(VARIANTS)


def expert_order(cfg, dtype: torch.dtype, device, variants=None) -> str:
    """The order the fused executor holds K3's routed experts in (backends/expert_layout.py): fragment order
    where cute-latent-moe's scope admits the model (any batch: above its range and in prefill the executor runs
    it 256 tokens a call), else the checkpoint's."""
    device = torch.device(device)
    if cfg.family != "kimi_k3" or device.type != "cuda":
        return expert_layout.CHECKPOINT
    v = next((v for v in (variants or _variants(device)) if v.name == "cute-latent-moe"), None)
    if v is None or v.supports(cfg, dtype, 1, device) is not None:
        return expert_layout.CHECKPOINT
    return expert_layout.FRAGMENT


class FusedExecutor(GraphExecutor):
    name = "fused"

    @classmethod
    def build_extra(cls, cfg, device, dtype: torch.dtype, shard) -> tuple[int, str] | None:
        """The re-layout of a stack of K3's routed experts into fragment order (backends/expert_layout.py), where
        this executor holds them so."""
        if not str(device).startswith("cuda") or expert_order(cfg, dtype, device) != expert_layout.FRAGMENT:
            return None
        return expert_layout.conversion_bytes(cfg, shard), "while the fused executor re-lays out a stack of routed experts"

    def __init__(self, plan: DecodePlan, weights: dict[str, torch.Tensor], cache: KVCache, *, parallel=None):
        any_w = next(iter(weights.values()))
        self.variants = _variants(any_w.device)
        self.dtype = any_w.dtype
        super().__init__(fuse_add_rmsnorm(plan), weights, cache, parallel=parallel)
        # K3's routed experts held in fragment order (backends/expert_layout.py): only the CuTe experts read
        # them, so every LATENT_MOE op runs cute_experts.latent_op (prefill and batches past 256 included)
        self.frag_experts = expert_layout.order_of(self.weights, self.plan) == expert_layout.FRAGMENT
        self._pack(weights)
        self.chosen: dict[tuple[str, int], str] = {}  # (op kind, batch) -> variant name or "reference: why"
        self.sampling = None  # SamplingParams when the step samples (set_sampling)
        self.seed = torch.zeros(1, dtype=torch.int64, device=self.device)  # the step's noise seed, in place
        self.sampled: tuple[torch.Tensor, torch.Tensor] | None = None  # (tokens, logprobs) of the last step
        self._length_free: dict[int, bool] = {}

    def _pack(self, caller: dict[str, torch.Tensor]) -> None:
        """Weights that read one input put one after another in memory (backends/fused/kernels/packed.pack_rows), so one
        projection reads them in one pass: each KDA layer's six input projections (triton-kda-fused), each MLP's
        gate and up (triton-mlp). The same values, in this executor's dict and the caller's (the old tensors are
        freed, as backends/expert_layout.py's are). Only for the variants shipped here."""
        from .kernels.kda_fused import in_names
        from .kernels.packed import pack_rows

        names = {v.name for v in self.variants}
        for op in self.plan.ops:
            if op.kind == ATTN_KDA and "triton-kda-fused" in names:
                pack_rows(self.weights, in_names(f"model.layers.{op.layer}.self_attn"), also=caller)
            elif op.kind == MLP and "triton-mlp" in names:
                pack_rows(self.weights, list(op.weights[:2]), also=caller)

    def _expert_order(self, plan: DecodePlan, weights: dict[str, torch.Tensor]) -> str:
        if not expert_layout.expert_pairs(plan):
            return expert_layout.CHECKPOINT
        return expert_order(plan.config, self.dtype, next(iter(weights.values())).device, self.variants)

    def set_sampling(self, params, batch: int = 1) -> bool:
        """Sample inside the decode steps of `batch` sequences with `params` (sampling.SamplingParams), or stop
        (None). Greedy and plain temperature sampling only (no top_p, top_k, min_p: params.truncates), batch <=
        SAMPLE_IN_STEP_MAX_BATCH; returns whether the step samples. Captured graphs are dropped when the choice
        changes (it is part of the graph)."""
        ok = (params is not None and not params.truncates and batch <= SAMPLE_IN_STEP_MAX_BATCH
              and not self._lm_head_split())
        new = params if ok else None
        if new != self.sampling:
            # drop the graphs and their memory pool: capturing into the pool of freed graphs trips the caching
            # allocator (seen on the H200: "use_count > 0 INTERNAL ASSERT")
            self._graphs.clear()
            self._pool = None
            self.sampling = new
        return new is not None

    def _lm_head_split(self) -> bool:
        """Whether this rank holds only its rows of the lm_head (expert parallelism, parallel/vocab.py): the step
        then runs torch_ops' LM_HEAD (its rows, then the all-gather), neither lm_head_sample nor the lm_head
        variant, which read a whole lm_head."""
        return self.parallel is not None and any(
            op.kind == LM_HEAD and self.weights[op.weights[0]].shape[0] != self.cfg.vocab_size for op in self.plan.ops)

    def _step_fn(self, step: Step) -> torch.Tensor:
        ctx = self.run_ops(step)
        self.sampled = (ctx.buf["sampled_tokens"], ctx.buf["sampled_logprobs"]) if self.sampling else None
        return ctx.buf["logits"]

    def _capture_extras(self) -> tuple:
        return (self.sampled,)

    def _after_replay(self, extras: tuple) -> None:
        self.sampled = extras[0]

    def length_free(self, batch: int) -> bool:
        """Yes when every attention op of the plan runs a Triton variant at this batch: the split attention
        kernels (backends/fused/kernels/gqa.py, backends/fused/kernels/mla.py) read each sequence's position from device memory and stop
        there, so the host's kv_len only sizes the split (backends/fused/kernels/splitk.py), and one graph captured at the
        cache's length serves every length (chunks past a sequence's position exit at once). KDA layers have
        no length. An attention op that falls back to the reference slices the cache on the host: buckets."""
        if batch not in self._length_free:  # asked at every decode step: decided once per batch size
            kinds = {op.kind for op in self.plan.ops if op.kind in LENGTH_OPS}
            self._length_free[batch] = all(self._pick(kind, batch) is not None for kind in kinds)
        return self._length_free[batch]

    def _pick(self, kind: str, batch: int):
        why = []
        for v in self.variants:
            if kind not in v.manifest.replaces:
                continue
            reason = v.supports(self.cfg, self.dtype, batch, self.device)
            if reason is None:
                self.chosen[(kind, batch)] = v.name
                return v
            why.append(f"{v.name}: {reason}")
        self.chosen.setdefault((kind, batch), "reference" + (f" ({'; '.join(why)})" if why else ""))
        return None

    def run_ops(self, step: Step, hook=None) -> StepContext:
        prefill = step.segments is not None
        if prefill and not self.frag_experts:  # prefill: the graph executor's ops (eager)
            return super().run_ops(step, hook)
        ctx = StepContext(self.cfg, self.weights, self.cache, step, self.experts_impl, self.parallel)
        picks: dict[str, object] = {}
        for op in self.plan.ops:
            if op.kind not in picks:  # prefill (fragment-ordered experts): the graph executor's ops but those
                picks[op.kind] = None if prefill else self._pick(op.kind, step.num_tokens)
            v = picks[op.kind]
            if self.frag_experts and op.kind == LATENT_MOE and (v is None or v.name != "cute-latent-moe"
                                                                  or self.parallel is not None):
                self._latent_frag(op, ctx, prefill)
            elif op.kind == LM_HEAD and self._lm_head_split():
                OP_IMPLS[op.kind](ctx, op)
            elif op.kind == LM_HEAD and self.sampling is not None and not prefill:
                from .kernels.lm_head import lm_head_sample

                tok, lp, logits = lm_head_sample(ctx.buf[op.inputs[0]], self.weights[op.weights[0]], self.sampling,
                                                 seed=self.seed)
                ctx.buf.update({op.outputs[0]: logits, "sampled_tokens": tok, "sampled_logprobs": lp})
            elif self.parallel is not None and op.kind in parallel_moe.KINDS:
                parallel_moe.run(self, v, op, ctx, step)
            elif v is None:
                OP_IMPLS[op.kind](ctx, op)
            else:
                outputs = {n: torch.empty(shape, dtype=dt, device=self.device)
                           for n, (shape, dt) in output_specs(self.cfg, op, ctx.buf, self.weights).items()}
                v.run(op, {n: ctx.buf[n] for n in op.inputs}, {n: self.weights[n] for n in op.weights}, outputs,
                      self.cfg, step, self.cache[op.cache] if op.cache else None)
                ctx.buf.update(outputs)
            if hook is not None:
                hook(op, ctx)
        return ctx

    def _latent_frag(self, op, ctx: StepContext, prefill: bool) -> None:
        """A LATENT_MOE op over fragment-ordered experts where cute-latent-moe does not run it as a variant:
        prefill, batches past its 256 tokens, and expert parallelism (this rank's experts, the router's ids made
        local, the fp32 partial sums combined over the ranks before the norm)."""
        from .kernels.cute_experts import latent_op

        x, ids, wts = (ctx.buf[n] for n in op.inputs)
        combine = None
        if self.parallel is not None:
            ids, combine = self.parallel.local_ids(ids), self.parallel.combine
        ctx.buf[op.outputs[0]] = latent_op(op, x, ids, wts, self.weights, self.cfg, combine=combine)
        if not prefill:
            self.chosen[(LATENT_MOE, ctx.step.num_tokens)] = "cute-latent-moe" + (
                " (expert parallel)" if self.parallel is not None else " (in chunks of 256 tokens)")
