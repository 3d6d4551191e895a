"""The `mega` executor: each decode step is one persistent CuTe DSL kernel launch (megadecode/backends/mega/), captured in a
CUDA graph per batch size. Each sequence's cache length is read inside the launch, so one graph serves every
length. Prefill runs the torch reference. bf16 weights on an sm_90 GPU; qwen3_moe and deepseek_v3, batch <= 64.

`generate` samples inside the launch (greedy, or temperature with top_p = 1: SAMPLE instructions after the
lm_head), like the fused executor; a wait that timed out inside the kernel is raised by `check_errors()` (the
engine calls it after generating; the error buffer is read once, not per step).
"""

from __future__ import annotations

import os

import torch

from ...cache import KVCache
from ...plan import DecodePlan
from ...step import Step
from .. import expert_layout
from ..torch.executor import TorchExecutor
from .pyvm_executor import stream_supports


class MegaExecutor(TorchExecutor):
    name = "mega"
    supports = classmethod(stream_supports)

    def __init__(self, plan: DecodePlan, weights: dict[str, torch.Tensor], cache: KVCache, *,
                 num_ctas: int | None = None, timeline: bool = False, delay_ns: int = 0, parallel=None):
        """`timeline`: record each instruction's times (MegaRuntime.timeline_rows); `delay_ns`: the debug build's
        random delays (0: off). Refuses expert parallelism (pyvm_executor.refuse_parallel)."""
        from .lower import check_plan
        from .pyvm_executor import refuse_parallel

        refuse_parallel(self.name, parallel)
        check_plan(plan, plan.config)
        why = self.supports(plan.config)
        if why:
            raise ValueError(why)
        super().__init__(plan, weights, cache)
        any_w = next(iter(weights.values()))
        self.device = any_w.device
        if self.device.type != "cuda":
            raise ValueError("the mega executor runs on a CUDA GPU (the `pyvm` executor interprets the same "
                             "instructions on the CPU)")
        if any_w.dtype != torch.bfloat16:
            raise ValueError(f"the mega executor runs bf16 weights, got {any_w.dtype} (use --dtype bfloat16)")
        major, minor = torch.cuda.get_device_capability(self.device)
        if (major, minor) != (9, 0):
            raise ValueError(f"the mega executor is built for sm_90 (H100/H200), this GPU is sm_{major}{minor}")
        self.num_ctas = num_ctas or int(os.environ.get("MEGADECODE_MEGA_CTAS", 0)) or None  # None: per build
        self.timeline, self.delay_ns = timeline, delay_ns
        # K3's routed experts in fragment order (frag_order): EXPERT_UP / EXPERT_DOWN on the tensor cores (F_FRAG)
        self.frag_experts = expert_layout.order_of(self.weights, plan) == expert_layout.FRAGMENT
        self.runtimes: dict[tuple, object] = {}
        self.graphs: dict[tuple, tuple] = {}
        self._pool = None
        self.sampling = None
        self.seed = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.sampled: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build_extra(cls, cfg, device, dtype: torch.dtype, shard) -> tuple[int, str] | None:
        """The re-layout of a stack of K3's routed experts into fragment order, where this executor holds them so."""
        if frag_order(cfg, device) != expert_layout.FRAGMENT:
            return None
        return (expert_layout.conversion_bytes(cfg, shard),
                "while the mega executor re-lays out a stack of routed experts")

    def _expert_order(self, plan: DecodePlan, weights: dict[str, torch.Tensor]) -> str:
        if not expert_layout.expert_pairs(plan):
            return expert_layout.CHECKPOINT
        return frag_order(plan.config, next(iter(weights.values())).device)

    def run_ops(self, step: Step, hook=None):
        """Prefill: the torch reference's ops; K3's LatentMoE over experts held in fragment order reads them
        restored (`restored_latent_moe`)."""
        if not self.frag_experts:
            return super().run_ops(step, hook)
        from ...plan import LATENT_MOE
        from ..torch.ops import OP_IMPLS, StepContext

        ctx = StepContext(self.cfg, self.weights, self.cache, step, self.experts_impl, self.parallel)
        for op in self.plan.ops:
            if op.kind == LATENT_MOE:
                restored_latent_moe(ctx, op)
            else:
                OP_IMPLS[op.kind](ctx, op)
            if hook is not None:
                hook(op, ctx)
        return ctx

    def set_sampling(self, params, batch: int = 1) -> bool:
        """Sample inside the launch (greedy, or plain temperature: no top_p, top_k, min_p); returns whether it does."""
        ok = params is not None and not params.truncates
        self.sampling = params if ok else None
        return ok

    def graph_lengths(self, batch: int, kv_lo: int, kv_hi: int) -> list[int]:
        """One graph per batch size serves every length (the launch reads the positions): capture it once."""
        return [self.cache.max_len]

    def _mode(self):
        if self.sampling is None:
            return None, 1.0
        return ("greedy", 1.0) if self.sampling.greedy else ("temperature", 1.0 / self.sampling.temperature)

    def runtime(self, batch: int, causal_rows: bool = False):
        from .isa import f32_bits
        from .lower import lower
        from .runtime import MegaRuntime, ring_build
        from .schedule import schedule

        mode, inv_t = self._mode()
        key = (batch, mode, inv_t, causal_rows)
        if key not in self.runtimes:
            ctas = self.num_ctas or default_ctas(self.device, ring_build(batch))
            prog = lower(self.cfg, self.weights, self.cache, batch, ctas, sample=mode, causal_rows=causal_rows)
            for ins in prog.instrs:
                if ins.op == "SAMPLE":
                    ins.args["inv_temp_bits"] = f32_bits(inv_t)
            self.runtimes[key] = MegaRuntime(schedule(prog, ctas), self.device, timeline=self.timeline,
                                             delay_ns=self.delay_ns)
        return key, self.runtimes[key]

    def _stage(self, rt, step: Step) -> None:
        rt.view("tokens").copy_(step.tokens)
        rt.view("positions").copy_(step.positions)
        rt.view("slots").copy_(step.slots)
        if "seed" in rt.prog.i32:
            rt.view("seed").copy_(self.seed)

    @torch.inference_mode()
    def decode(self, step: Step) -> torch.Tensor:
        B = step.num_tokens
        key, rt = self.runtime(B, step.causal_rows)
        entry = self.graphs.get(key)
        if entry is None:
            static = Step(tokens=step.tokens.clone(), positions=step.positions.clone(), slots=step.slots.clone(),
                          logit_rows=step.logit_rows, kv_len=step.kv_len)
            saved = self.cache.save_state()  # the warm-up launch advances KDA state; the replay must start from it
            self._stage(rt, static)
            rt.launch()  # compiles on first use; the same step's cache writes, repeated by the replay
            self.flag_nonfinite(rt.view("logits").view(B, -1), static)
            torch.cuda.synchronize(self.device)
            rt.check()
            self.cache.restore_state(saved)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._stage(rt, static)
                rt.launch()
                self.flag_nonfinite(rt.view("logits").view(B, -1), static)  # on the device, in the graph
            self._pool = graph.pool()
            entry = self.graphs[key] = (graph, static)
        graph, static = entry
        static.tokens.copy_(step.tokens, non_blocking=True)
        static.positions.copy_(step.positions, non_blocking=True)
        static.slots.copy_(step.slots, non_blocking=True)
        graph.replay()
        if self.sampling is not None:
            self.sampled = (rt.view("sampled")[:B].long(), rt.view("sampled_lp")[:B])
        return rt.view("logits").view(B, -1)

    def check_errors(self) -> None:
        """Raise mega.runtime.MegaError if any launch reported a wait that timed out."""
        for rt in self.runtimes.values():
            rt.check()


def default_ctas(device, ring: bool = True) -> int:
    """Every CTA the GPU holds at once: SMs x the build's resident CTAs per SM (registers, shared memory)."""
    from . import cute_kernel as K
    from .runtime import compiled_launcher, ctas_per_sm, launcher_registers

    regs = launcher_registers(compiled_launcher(device, ring))  # the launches' own compile or cache entry
    per_sm = ctas_per_sm(regs, K.block_threads(ring), K.block_smem(ring))
    return max(1, per_sm) * torch.cuda.get_device_properties(device).multi_processor_count


def frag_order(cfg, device) -> str:
    """The order the mega executor holds K3's routed experts in: fragment order (quant/mxfp4_frag.py, read by the
    tensor-core bodies under F_FRAG) on a GPU where the latent and intermediate widths are whole records (multiples
    of 256, as K3's 3584 and 3072 are), else the checkpoint's (the CUDA-core bodies; the tiny presets)."""
    from ...quant.mxfp4_frag import KREC

    if cfg.family != "kimi_k3" or torch.device(device).type != "cuda":
        return expert_layout.CHECKPOINT
    if cfg.latent_size % KREC or cfg.moe_intermediate_size % KREC:
        return expert_layout.CHECKPOINT
    return expert_layout.FRAGMENT


class _Restored:
    """Routed experts held in fragment order, read one expert at a time as the reference reads a stack of
    experts: `stack[e]` is expert e restored exactly to the checkpoint's order (quant/mxfp4_frag.restore) and
    decoded to fp32, as MXFP4Tensor's rows decode. Only the expert being multiplied is ever restored: a prefill of
    many tokens selects most of K3's 896 experts, and restoring the selection at once ran the H200 out of memory
    in `megadecode bench --preset k3-mini --executor mega --batch 8` (an allocation of 16.57 GiB refused)."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor):
        from ...quant.mxfp4_frag import frag_from_entries

        self.frag = frag_from_entries(packed, scales)

    def __getitem__(self, e: int) -> torch.Tensor:
        from ...quant.mxfp4 import MXFP4Tensor
        from ...quant.mxfp4_frag import MXFP4Frag, restore

        f = self.frag
        part = restore(MXFP4Frag(f.data[e:e + 1].contiguous(), torch.Size((1, *f.shape[1:]))))
        return MXFP4Tensor(part.packed, part.scales)[0].dequantize(torch.float32)


def restored_latent_moe(ctx, op) -> None:
    """The torch reference's LATENT_MOE op (backends/torch/ops.py: latent down, reference/latent_moe.py's loop
    over the selected experts, the norm of the weighted sum, latent up) over routed experts held in fragment
    order, each selected expert restored when the loop reaches it (`_Restored`): the same values in the same
    order as on checkpoint-order weights. The mega executor holds no expert parallelism (no combine)."""
    import torch.nn.functional as F

    from ...reference.latent_moe import latent_experts
    from ...reference.norm import rms_norm

    x, ids, wts = (ctx.buf[n] for n in op.inputs)
    down_w, gu_p, gu_s, dn_p, dn_s, norm_w, up_w = (ctx.w[n] for n in op.weights)
    h = F.linear(x.float(), down_w.float())
    z = latent_experts(h, ids, wts, _Restored(gu_p, gu_s), _Restored(dn_p, dn_s), ctx.cfg.expert_act)
    z = rms_norm(z, norm_w.float(), ctx.cfg.rms_norm_eps)
    ctx.buf[op.outputs[0]] = F.linear(z, up_w.float()).to(x.dtype)
