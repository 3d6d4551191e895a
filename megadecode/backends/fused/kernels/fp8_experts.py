"""Routed experts with FP8 block-scaled weights (DeepSeek-V3, Kimi K2, Qwen3-*-FP8; megadecode/quant/fp8.py),
decoded in registers: no dequantized copy of the experts is ever written.

    out[t] = sum_a w[t, a] * down_e (silu(gate_e x_t) * up_e x_t),   e = ids[t, a]

Legend as backends/fused/kernels/fused_experts.py (T tokens, A active experts per token, E experts, D hidden, I expert
intermediate, a pair p = t * A + a). Weights: gate_up float8_e4m3fn [E, 2I, D] + weight_scale_inv fp32
[E, 2I/SBN, ceil(D/SBK)], down [E, D, I] + [E, ceil(D/SBN), ceil(I/SBK)]; (SBN, SBK) = the checkpoint's
weight_block_size, [128, 128] in every released one.

The structure of backends/fused/kernels/grouped_experts.py (tensor cores, weights on the MMA's M side and 16 pairs on its N side;
per pair at <= 16 tokens, pairs grouped by expert on the device above, each selected expert then read once per
step; a fixed-order weighted combine: deterministic, no atomics), three launches:
  1. `fp8_up_kernel`, grid (E or T*A, cdiv(I, BLOCK_I)): h[p, i] = silu(gate_e[i] . x_t) * (up_e[i] . x_t), fp32.
  2. `fp8_down_kernel`, grid (E or T*A, cdiv(D, BLOCK_N)): y[p, n] = down_e[n, :] . h[p, :], fp32.
  3. grouped_experts.combine_kernel: out[t] = sum_{a in order} w[t, a] y[t*A + a] (negative ids left out).
The FP8 dot (`_fp8_dot`): per chunk of BLOCK_K (<= SBK, dividing it: the chunk lies in one scale column) the
weight tile is converted to the compute dtype WDT (e4m3 -> bf16 / fp16 / fp32 is exact: 3 mantissa bits, exponents
2**-9 .. 2**8), multiplied with the activations on tensor cores (fp32 accumulation), and the chunk's fp32 partial
sum is multiplied by each row's block scale before it is added: the same products as dequantize-then-matmul,
summed in another order (the scale applied once per chunk instead of once per weight).
WDT: bf16 on the GPU (activations in bf16 as they are; fp32 activations split into bf16 hi + lo, ~16 bits), fp16
for fp16 activations, fp32 on the CPU (the Triton interpreter computes bf16 arithmetic wrongly; IEEE fp32 dots).
h enters the down products split into WDT hi + lo parts, as in grouped_experts. NaN weight codes (0x7F, 0xFF) are
NaN on the GPU; the interpreter decodes them as +-480 (a broken checkpoint either way: load with check_finite).

Memory paths: the expert weights and scales are static; x, ids, order, offs, router weights, h and y are produced
within the step and read with plain coherent loads (the static audit: tests/test_fp8_experts.py, `audit_specs`).
Contract for ids: 0 <= ids < E (the router's), or -1: a pair to skip (expert parallelism; grouped_experts' module
doc); `check_ids=True` verifies on the host (debug, syncs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....contract import Manifest, Scope, Variant, kernel_spec, register
from ....plan import EXPERTS
from ....quant.fp8 import FP8Tensor
from .common import mma, run_of
from . import tuning
from .fused_experts import _device_name, shape_key
from .grouped_experts import BLOCK_C, MAX_BATCH, combine_kernel, group_pairs

KERNEL = "fp8-experts"
MAX_TOKENS = 16  # per pair up to this batch (no sort), grouped by expert above: grouped_experts' measured choice
DEFAULT_BLOCKS = {"BLOCK_M": 16, "BLOCK_I": 64, "BLOCK_D": 128, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4,
                  "num_stages": 3}  # grouped_experts' defaults; a GPU's tuned configs (`megadecode tune --kernel
# fp8-experts`, configs/fp8-experts/<gpu>.json) replace them per shape and batch where the tuner has run
WDTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _fp8_dot(w_ptr, s_ptr, w_off, s_off, rows, row_ok, stride_wr, stride_sr, v_ptr, v_rows, m_ok,
             K: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
             BLOCK_K: tl.constexpr, WDT: tl.constexpr, SPLIT: tl.constexpr):
    """[BLOCK_R, BLOCK_M] fp32: W[rows, :K] . v[m, :K] for one expert's FP8 matrix at w_ptr + w_off (its scales at
    s_ptr + s_off, one per SBN x SBK block) and the BLOCK_M activation rows at v_ptr + v_rows[m] (masked by m_ok).
    BLOCK_K divides SBK, so chunk k0 has one scale per row: scale[rows // SBN, k0 // SBK]."""
    acc = tl.zeros((BLOCK_R, BLOCK_M), dtype=tl.float32)
    s_rows = (rows // SBN).to(tl.int64) * stride_sr
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        w = tl.load(w_ptr + w_off + rows[:, None] * stride_wr + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0, eviction_policy="evict_first")
        v = tl.load(v_ptr + v_rows[None, :] + k[:, None], mask=k_ok[:, None] & m_ok[None, :], other=0.0)
        part = mma(w.to(WDT), v, tl.zeros((BLOCK_R, BLOCK_M), dtype=tl.float32), SPLIT)
        s = tl.load(s_ptr + s_off + s_rows + k0 // SBK, mask=row_ok, other=0.0, eviction_policy="evict_first")
        acc += part * s[:, None]
    return acc


@triton.jit
def fp8_up_kernel(x_ptr, ids_ptr, order_ptr, offs_ptr, gu_ptr, gus_ptr, h_ptr, stride_x, stride_gu_e, stride_gu_r,
                  stride_gus_e, stride_gus_r, D: tl.constexpr, I: tl.constexpr, A: tl.constexpr, SBN: tl.constexpr,
                  SBK: tl.constexpr, GROUPED: tl.constexpr, SPLIT: tl.constexpr, WDT: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (e or pair, i-tile): for each pair p of its run, h[p, i] = silu(gate_e[i] . x_t) * (up_e[i] . x_t)."""
    e, start, end = run_of(tl.program_id(0), ids_ptr, offs_ptr, GROUPED)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    i_ok = i < I
    w_off = e.to(tl.int64) * stride_gu_e
    s_off = e.to(tl.int64) * stride_gus_e
    m0 = start
    while m0 < end:  # a while loop: the interpreter cannot take a range() over loaded bounds
        m = m0 + tl.arange(0, BLOCK_M)
        m_ok = m < end
        if GROUPED:
            p = tl.load(order_ptr + m, mask=m_ok, other=0)
        else:
            p = m
        x_rows = (p // A).to(tl.int64) * stride_x
        g = _fp8_dot(gu_ptr, gus_ptr, w_off, s_off, i, i_ok, stride_gu_r, stride_gus_r, x_ptr, x_rows, m_ok,
                     D, SBN, SBK, BLOCK_M, BLOCK_I, BLOCK_D, WDT, SPLIT)
        u = _fp8_dot(gu_ptr, gus_ptr, w_off, s_off, I + i, i_ok, stride_gu_r, stride_gus_r, x_ptr, x_rows, m_ok,
                     D, SBN, SBK, BLOCK_M, BLOCK_I, BLOCK_D, WDT, SPLIT)
        h = g / (1.0 + tl.exp(-g)) * u
        tl.store(h_ptr + p.to(tl.int64)[None, :] * I + i[:, None], h, mask=i_ok[:, None] & m_ok[None, :])
        m0 += BLOCK_M


@triton.jit
def fp8_down_kernel(h_ptr, ids_ptr, order_ptr, offs_ptr, dn_ptr, dns_ptr, y_ptr, stride_dn_e, stride_dn_r,
                    stride_dns_e, stride_dns_r, D: tl.constexpr, I: tl.constexpr, SBN: tl.constexpr,
                    SBK: tl.constexpr, GROUPED: tl.constexpr, WDT: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (e or pair, n-tile): for each pair p of its run, y[p, n] = down_e[n, :] . h[p, :]."""
    e, start, end = run_of(tl.program_id(0), ids_ptr, offs_ptr, GROUPED)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < D
    w_off = e.to(tl.int64) * stride_dn_e
    s_off = e.to(tl.int64) * stride_dns_e
    m0 = start
    while m0 < end:
        m = m0 + tl.arange(0, BLOCK_M)
        m_ok = m < end
        if GROUPED:
            p = tl.load(order_ptr + m, mask=m_ok, other=0).to(tl.int64)
        else:
            p = m.to(tl.int64)
        y = _fp8_dot(dn_ptr, dns_ptr, w_off, s_off, n, n_ok, stride_dn_r, stride_dns_r, h_ptr, p * I, m_ok,
                     I, SBN, SBK, BLOCK_M, BLOCK_N, BLOCK_K, WDT, True)
        tl.store(y_ptr + p[None, :] * D + n[:, None], y, mask=n_ok[:, None] & m_ok[None, :])
        m0 += BLOCK_M


# ---- launcher -----------------------------------------------------------------------------------------
def _check(name: str, w: FP8Tensor, shape: tuple[int, ...]) -> None:
    if not isinstance(w, FP8Tensor):
        raise ValueError(f"{name} must be an FP8Tensor (float8_e4m3fn values + block scales), got {type(w).__name__}")
    if tuple(w.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(w.shape)}, expected {shape}")
    if not (w.data.is_contiguous() and w.scales.is_contiguous()) or w.scales.dtype != torch.float32:
        raise ValueError(f"{name}: values and fp32 scales must be contiguous (got scales {w.scales.dtype})")


def reason_unsupported(block: tuple[int, int] | None, I: int) -> str | None:
    """Why these kernels cannot take FP8 experts with this weight_block_size, or None."""
    if block is None:
        return "experts are not FP8"
    sbn, sbk = block
    if sbk < 16 or sbk & (sbk - 1):
        return f"weight_block_size[1] = {sbk}: the K chunks must divide it, a power of two >= 16"
    if I % sbn:
        return f"moe_intermediate_size {I} is not a multiple of weight_block_size[0] = {sbn}"
    return None


def fp8_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: FP8Tensor, down: FP8Tensor, *,
                out: torch.Tensor | None = None, grouped: bool | None = None, blocks: dict | None = None,
                wdtype: torch.dtype | None = None, check_ids: bool = False) -> torch.Tensor:
    """Routed experts (SwiGLU) with FP8 weights: x [T, D] fp32/fp16/bf16, ids [T, A] int64/int32 (0 <= ids < E,
    or -1 to skip a pair), weights [T, A] fp32, gate_up FP8Tensor [E, 2I, D], down FP8Tensor [E, D, I] with the
    same block. Writes and returns out [T, D] (x.dtype, or float32 when `out` is given so). grouped: None =
    grouped above MAX_TOKENS tokens. wdtype: the tensor-core input dtype (None: bf16 on CUDA, fp16 for fp16 x,
    fp32 on the CPU). Sync-free (CUDA-graph capturable)."""
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in WDTYPES:
        raise ValueError(f"x must be [T, D] fp32/fp16/bf16 with unit stride over D, got {tuple(x.shape)} {x.dtype}")
    T, D = x.shape
    if T > MAX_BATCH:
        raise ValueError(f"fp8_experts handles batch <= {MAX_BATCH}, got {T}")
    if ids.dim() != 2 or ids.shape[0] != T or ids.dtype not in (torch.int64, torch.int32) or not ids.is_contiguous():
        raise ValueError(f"ids must be contiguous [T={T}, A] int64/int32, got {tuple(ids.shape)} {ids.dtype}")
    A = ids.shape[1]
    if weights.shape != ids.shape or weights.dtype != torch.float32 or not weights.is_contiguous():
        raise ValueError(f"weights must be contiguous [T, A]={tuple(ids.shape)} fp32, got {tuple(weights.shape)}")
    E, I = gate_up.shape[0], gate_up.shape[1] // 2
    _check("gate_up", gate_up, (E, 2 * I, D))
    _check("down", down, (E, D, I))
    if gate_up.block != down.block:
        raise ValueError(f"gate_up and down have different blocks {gate_up.block} and {down.block}")
    why = reason_unsupported(gate_up.block, I)
    if why:
        raise ValueError(why)
    if check_ids and T and (int(ids.min()) < -1 or int(ids.max()) >= E):
        raise ValueError(f"ids out of range [-1, {E}) (-1: skip the pair): min {int(ids.min())}, "
                         f"max {int(ids.max())}")
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    if out.shape != (T, D) or out.dtype not in (x.dtype, torch.float32) or out.stride(1) != 1:
        raise ValueError(f"out must be [T, D]=({T}, {D}) {x.dtype} (or float32) with unit stride over D")
    if len({t.device for t in (x, ids, weights, gate_up.data, down.data, out)}) != 1:
        raise ValueError("all tensors must be on one device")
    if T == 0:
        return out
    if wdtype is None:
        wdtype = (torch.float16 if x.dtype == torch.float16 else torch.bfloat16) if x.is_cuda else torch.float32
    grouped = T > MAX_TOKENS if grouped is None else grouped
    sbn, sbk = gate_up.block
    gpu = _device_name(x.device)
    if blocks is None and gpu is not None:
        blocks = tuning.lookup(KERNEL, gpu, tuned_key(D, I, A, gate_up.block, grouped), T)
    b = {**DEFAULT_BLOCKS, **(blocks or {})}
    bm = max(16, triton.next_power_of_2(b["BLOCK_M"]))
    bi = max(16, min(b["BLOCK_I"], triton.next_power_of_2(I)))
    bn = max(16, min(b["BLOCK_N"], triton.next_power_of_2(D)))
    bd = max(16, min(b["BLOCK_D"], sbk, triton.next_power_of_2(D)))  # chunks inside one scale column
    bk = max(16, min(b["BLOCK_K"], sbk, triton.next_power_of_2(I)))
    if sbk % bd or sbk % bk:
        raise ValueError(f"BLOCK_D ({bd}) and BLOCK_K ({bk}) must divide weight_block_size[1] ({sbk})")
    if grouped:
        order, offs = group_pairs(ids, E)
        rows = E
    else:
        order = offs = ids  # unused pointers
        rows = T * A
    h = torch.empty(T * A, I, dtype=torch.float32, device=x.device)
    y = torch.empty(T * A, D, dtype=torch.float32, device=x.device)
    gu, gus, dn, dns = gate_up.data, gate_up.scales, down.data, down.scales
    wdt = WDTYPES[wdtype]
    split = x.dtype == torch.float32 and wdtype != torch.float32
    kw = {"num_warps": b["num_warps"], "num_stages": b["num_stages"]}
    fp8_up_kernel[(rows, triton.cdiv(I, bi))](
        x, ids, order, offs, gu, gus, h, x.stride(0), gu.stride(0), gu.stride(1), gus.stride(0), gus.stride(1),
        D=D, I=I, A=A, SBN=sbn, SBK=sbk, GROUPED=grouped, SPLIT=split, WDT=wdt, BLOCK_M=bm, BLOCK_I=bi,
        BLOCK_D=bd, **kw)
    fp8_down_kernel[(rows, triton.cdiv(D, bn))](
        h, ids, order, offs, dn, dns, y, dn.stride(0), dn.stride(1), dns.stride(0), dns.stride(1), D=D, I=I,
        SBN=sbn, SBK=sbk, GROUPED=grouped, WDT=wdt, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **kw)
    combine_kernel[(T, triton.cdiv(D, BLOCK_C))](y, ids, weights, out, out.stride(0), D=D, A=A, BLOCK_C=BLOCK_C)
    return out


def tuned_key(D: int, I: int, A: int, block: tuple[int, int], grouped: bool) -> str:
    """The tuning-file key of a problem: fused_experts.shape_key's with wdtype fp8 and the weights' block."""
    return shape_key(D, I, A, "fp8", "silu") + f",block={block[0]}x{block[1]},grouped={int(grouped)}"


def tuning_key(D: int, I: int, A: int, wdtype: str, act: str, T: int) -> str:
    """The key fp8_experts looks up at batch T with grouped=None, for `megadecode tune` (its random FP8 weights
    have blocks of 128 x 128, measure.expert_weights)."""
    if wdtype != "fp8" or act != "silu":
        raise ValueError(f"fp8-experts tunes FP8 weights with silu, not {wdtype} with {act}")
    return tuned_key(D, I, A, (128, 128), T > MAX_TOKENS)


def launch(x, ids, w, gu, dn, act, out, blocks):
    """The tuner's entry point: one call with explicit blocks (per pair at <= 16 tokens, grouped above)."""
    if act != "silu":
        raise ValueError(f"fp8_experts computes SwiGLU (silu), not {act}")
    return fp8_experts(x, ids, w, gu, dn, out=out, blocks=blocks)


# ---- static audit description -------------------------------------------------------------------------
def audit_specs(dtype: str = "bf16", D: int = 2048, I: int = 768, A: int = 8, grouped: bool = True,
                block: tuple[int, int] = (128, 128)) -> list:
    """KernelSpecs of the three launches for megadecode.validate.audit.audit_kernel (defaults: Qwen3-30B-A3B-FP8):
    expert values and scales "static", every other pointer "produced"."""
    b = DEFAULT_BLOCKS
    wdt = "fp16" if dtype == "fp16" else "bf16"
    strides = ("stride_gu_e", "stride_gu_r", "stride_gus_e", "stride_gus_r")
    up_sig = {"x_ptr": f"*{dtype}", "ids_ptr": "*i64", "order_ptr": "*i32", "offs_ptr": "*i32", "gu_ptr": "*fp8e4nv",
              "gus_ptr": "*fp32", "h_ptr": "*fp32", "stride_x": "i32", **{s: "i32" for s in strides}}
    common = {"SBN": block[0], "SBK": block[1], "GROUPED": grouped, "WDT": getattr(tl, {"fp16": "float16"}.get(
        wdt, "bfloat16")), "BLOCK_M": b["BLOCK_M"]}
    up_c = {"D": D, "I": I, "A": A, **common, "SPLIT": dtype == "fp32", "BLOCK_I": b["BLOCK_I"],
            "BLOCK_D": min(b["BLOCK_D"], block[1])}
    dn_sig = {"h_ptr": "*fp32", "ids_ptr": "*i64", "order_ptr": "*i32", "offs_ptr": "*i32", "dn_ptr": "*fp8e4nv",
              "dns_ptr": "*fp32", "y_ptr": "*fp32", **{s: "i32" for s in ("stride_dn_e", "stride_dn_r",
                                                                         "stride_dns_e", "stride_dns_r")}}
    dn_c = {"D": D, "I": I, **common, "BLOCK_N": b["BLOCK_N"], "BLOCK_K": min(b["BLOCK_K"], block[1])}
    cb_sig = {"y_ptr": "*fp32", "ids_ptr": "*i64", "wts_ptr": "*fp32", "out_ptr": f"*{dtype}", "stride_out": "i32"}
    return [kernel_spec(fp8_up_kernel, up_sig, up_c, static=("gu_ptr", "gus_ptr")),
            kernel_spec(fp8_down_kernel, dn_sig, dn_c, static=("dn_ptr", "dns_ptr")),
            kernel_spec(combine_kernel, cb_sig, {"D": D, "A": A, "BLOCK_C": BLOCK_C})]


# ---- the harness variant ----------------------------------------------------------------------------
def _dims(cfg) -> str | None:
    """FP8 experts with a weight_block_size the kernels take"""
    if cfg.expert_quant != "fp8":
        return "experts are not FP8 (triton-grouped-experts runs float experts)"
    return reason_unsupported(cfg.weight_block, cfg.moe_intermediate_size)


def _run(op, inputs, weights, outputs, cfg, step, cache=None):
    x, ids, wts = (inputs[n] for n in op.inputs)
    gu, gus, dn, dns = (weights[n] for n in op.weights)
    fp8_experts(x.contiguous(), ids.contiguous(), wts.float().contiguous(), FP8Tensor(gu, gus, cfg.weight_block),
                FP8Tensor(dn, dns, cfg.weight_block), out=outputs[op.outputs[0]])


FP8_EXPERTS_VARIANT = register(Variant(Manifest(
    name="triton-fp8-experts",
    description="routed experts with FP8 block-scaled weights (float8_e4m3fn + fp32 weight_scale_inv per block) "
                "decoded in registers: each chunk of a weight tile converted exactly to bf16 (fp32 on the CPU), "
                "multiplied on tensor cores with fp32 accumulation, the partial sums scaled by their block scale; "
                "per pair at <= 16 tokens, grouped by expert on the device above; a fixed-order combine. Against "
                "the torch reference (dequantized fp32 weights, fp32 math): the same products summed in another "
                "order, activations in bf16 (fp32 activations as bf16 hi + lo), h as bf16 hi + lo",
    replaces=(EXPERTS,),
    scope=Scope(families=("qwen3_moe", "deepseek_v3"), dtypes=("float32", "float16", "bfloat16"),
                devices=("cpu", "cuda"), batch=(1, 256), arch="sm_90", dims=_dims),
    sources=("megadecode/backends/fused/kernels/fp8_experts.py", "megadecode/backends/fused/kernels/common.py"), uses_triton=True,
    graph_capturable=True,
    # fp32 activations on the GPU take the SPLIT path of the up kernel (x as bf16 hi + lo): declared and audited too
    kernels=lambda: (audit_specs(grouped=False) + audit_specs(grouped=True)[:2]
                     + [audit_specs("fp32", grouped=g)[0] for g in (False, True)])),
    _run, kernel=fp8_up_kernel))
