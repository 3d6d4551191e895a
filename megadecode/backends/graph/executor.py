"""The `graph` executor: the plan's per-op decode step without host syncs, captured in a CUDA graph.

This is the strongest classic baseline: same ops as `torch`, but routed experts go through
`torch._grouped_mm` with device-side offsets (each selected expert read once), and the whole decode
step (embedding to logits) replays as one graph. One graph per (batch size, attended cache length
rounded up to KV_BUCKET), so attention reads about the live context, not the whole allocation.
Prefill runs eagerly. Without CUDA the same sync-free ops run eagerly (how CI tests this path).
kimi_k3: the LatentMoE routed experts (MXFP4) of a decode step run through the Triton routed experts
(backends/fused/kernels/grouped_experts.py routed_experts: the fused small-batch kernels at <= 16 sequences, the kernels
grouped by expert above; no host sync; torch_ops `_latent_routed`); the rest of the op (router, latent
down, latent norm, latent up, shared experts) is the reference math. Prefill (eager) keeps the reference
expert loop. Validated on the CPU in fp32 under the Triton interpreter (tests/test_k3_graph.py) and on the
H200 (docs/evidence/k3-gpu-smoke-h200.json).
"""

from __future__ import annotations

import dataclasses

import torch

from ...cache import KVCache
from ...plan import DecodePlan
from ...step import Step
from ..torch.executor import TorchExecutor

KV_BUCKET = 256


class GraphExecutor(TorchExecutor):
    name = "graph"
    experts_impl = "grouped"

    def __init__(self, plan: DecodePlan, weights: dict[str, torch.Tensor], cache: KVCache, *, parallel=None):
        super().__init__(plan, weights, cache, parallel=parallel)
        self.device = next(iter(weights.values())).device
        self.use_graphs = self.device.type == "cuda"
        self._graphs: dict[tuple[int, int, bool], tuple] = {}
        self._pool = None

    def _step_fn(self, step: Step) -> torch.Tensor:
        return self.run_ops(step).buf["logits"]

    def _flagged_step(self, step: Step) -> torch.Tensor:
        """The decode step as captured: the logits, with the non-finite flag updated inside the graph (the
        compiled executor compiles `_step_fn` alone)."""
        logits = self._step_fn(step)
        self.flag_nonfinite(logits, step)
        return logits

    def _bucket(self, kv_len: int) -> int:
        return min(-(-kv_len // KV_BUCKET) * KV_BUCKET, self.cache.max_len)

    def length_free(self, batch: int) -> bool:
        """Whether the decode step of `batch` sequences reads the sequences' lengths from device memory only,
        so that one graph, captured at kv_len = the cache's length, serves every length. Here no: the
        reference attention slices the cache to kv_len on the host (reading about the live context, not the
        whole allocation), so there is one graph per KV_BUCKET of lengths."""
        return False

    def graph_lengths(self, batch: int, kv_lo: int, kv_hi: int) -> list[int]:
        if not self.use_graphs:
            return []
        if self.length_free(batch):
            return [self.cache.max_len]
        first, last = -(-max(kv_lo, 1) // KV_BUCKET), -(-max(kv_hi, kv_lo, 1) // KV_BUCKET)
        return sorted({min(k * KV_BUCKET, self.cache.max_len) for k in range(first, last + 1)})

    def _capture_extras(self) -> tuple:
        """Outputs besides the logits that a subclass's _step_fn leaves behind, kept with the graph."""
        return ()

    def _after_replay(self, extras: tuple) -> None:
        """Hook for a subclass: the captured extras of the graph just replayed."""

    @torch.inference_mode()
    def decode(self, step: Step) -> torch.Tensor:
        if self.length_free(step.num_tokens) and step.kv_len != self.cache.max_len:
            step = dataclasses.replace(step, kv_len=self.cache.max_len)  # eager too: what the graph runs
        if not self.use_graphs:
            return self._flagged_step(step)
        B, L = step.num_tokens, self._bucket(step.kv_len)
        key = (B, L, step.contiguous_slots)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(step, L)
            self._graphs[key] = entry
        graph, static, logits, extras = entry
        static.tokens.copy_(step.tokens, non_blocking=True)
        static.positions.copy_(step.positions, non_blocking=True)
        static.slots.copy_(step.slots, non_blocking=True)
        graph.replay()
        self._after_replay(extras)
        return logits

    def _capture(self, step: Step, kv_len: int):
        B = step.num_tokens
        static = Step(tokens=step.tokens.clone(), positions=step.positions.clone(), slots=step.slots.clone(),
                      logit_rows=torch.arange(B, device=self.device), kv_len=kv_len,
                      contiguous_slots=step.contiguous_slots)
        # Warm-up on a side stream (allocator, lazy init). It repeats this step's own cache writes, so
        # it leaves the KV cache as the real replay will. Recurrent state (KDA) is not idempotent: each
        # run advances it, so it is saved before the warm-up and put back after.
        saved = self.cache.save_state()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._flagged_step(static)
        torch.cuda.current_stream().wait_stream(side)
        self.cache.restore_state(saved)  # RESTORE_KDA_STATE
        if self.parallel is not None:  # no NCCL work of the warm-up still in flight while the combines are captured
            torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._flagged_step(static)
        self._pool = graph.pool()
        return graph, static, logits, self._capture_extras()


class CompiledGraphExecutor(GraphExecutor):
    """`graph` with the decode step compiled by `torch.compile` (inductor fuses the elementwise chains
    into Triton kernels) before capture: the gpt-fast recipe. Compiles once per (batch, cache-length
    bucket); bf16/fp16 only on CUDA (`torch._grouped_mm` has no fp32 path there)."""

    name = "compiled"
    # Families whose compiled step matches the torch executor on the H200 (tests/test_gpu.py, bf16,
    # 8 decode steps). deepseek_v3 does not (relative logit error 0.22 on tiny-deepseek-v3).
    # Reproduced on the CPU (bf16; the script is in `git log -- bench/compile_drift.py`): every op compiled
    # alone matches eager within one bf16 ulp, but the whole-step compile keeps fused intermediates in fp32,
    # the residual drifts by a few ulps per layer (0.027 abs on the layer-2 router input) and that flips one
    # near-tied expert choice (4th/5th choice gaps down to 0.006), after which the logits differ by 17%. That is
    # numerics, not a wrong formula, but until the harness compares MoE outputs routing-aware, the family stays
    # out of scope.
    # config/registry.py lists the families it is validated for.

    def __init__(self, plan: DecodePlan, weights: dict[str, torch.Tensor], cache: KVCache, *, parallel=None):
        why = self.supports(plan.config)
        if why:
            raise ValueError(why)
        if parallel is not None and parallel.world > 1:
            raise ValueError("the compiled executor is not validated with expert parallelism (torch.compile over the "
                             "combine's collectives was never run): use 'graph' or 'fused'")
        super().__init__(plan, weights, cache, parallel=parallel)
        self._compiled = torch.compile(super()._step_fn, dynamic=False)

    def _step_fn(self, step: Step) -> torch.Tensor:
        return self._compiled(step) if self.use_graphs else super()._step_fn(step)
