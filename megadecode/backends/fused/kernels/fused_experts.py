"""Small-batch fused routed experts (issue 5, first kernel): two Triton launches, no align/sort pass.

    out[t] = sum_a w[t, a] * down_e (act(gate_e x_t, up_e x_t)),   e = ids[t, a]

Legend: T tokens (<= 16 here), A active experts per token, E experts, D hidden (the input of gate_up,
the output of down), I expert intermediate; a pair p = t * A + a is one (token, selected expert).
Weights: gate_up [E, 2I, D] (gate rows first, then up rows), down [E, D, I], float (fp32/fp16/bf16) or
MXFP4 (megadecode/quant/mxfp4.py: packed uint8 [E, out, in/2], even element in the LOW nibble; e8m0
scale uint8 [E, out, in/32]), decoded in registers in fp32.

Stage 1 (`experts_up_kernel`), grid (T*A, cdiv(I, BLOCK_I)): h[p, i-tile] = act(gate_e . x_t, up_e . x_t)
    in fp32 (accumulated over D in BLOCK_D chunks), written to a fp32 scratch h [T*A, I].
Stage 2 (`experts_down_kernel`), grid (T, cdiv(D, BLOCK_N)): out[t, n-tile] = sum_a w[t, a] *
    (down_e[n-tile, :] . h[t*A + a, :]), fp32, over a in the fixed order 0..A-1 (no atomics: the result is
    deterministic and each token's row depends on that token only, so it is batch invariant), cast to
    x.dtype.

Why no sort by expert at batch <= 16: each pair reads its own expert's rows through ids, so an expert
picked by several tokens is read once per pair (the repeats mostly hit L2: a selected expert's slice for
one program is small and the pairs sharing it run concurrently). At decode batch the selected experts are
mostly distinct (K3: T*A = 16*T picks from 896 experts), so the sort/offsets pass a grouped GEMM needs
would cost a launch (and its sync-free bookkeeping) to save little traffic. At larger batch the repeats
grow and the grouped kernels (backends/fused/kernels/grouped_experts.py) take over: the launcher refuses T > 16. Since the
tensor-core kernels there measured faster (docs/evidence/experts-paths-h200.md), these FMA kernels are the
path only for MXFP4 weights whose scales rule out the fast decode, and on the CPU (routed_experts).

Memory paths: expert weights are static (they may take the non-coherent path); x, ids, the router weights
and the h scratch are produced during a step and are read with plain coherent loads (no cache modifier,
no read-only hint); the static audit (tests/test_fused_experts.py) checks both kernels at sm_90.

Contract for ids: 0 <= ids < E, as the router writes them, or -1: a pair to skip (expert parallelism,
megadecode/parallel: the expert is another rank's). A skipped pair's programs load no weights, write h = 0 (the
activation of zero gate and up sums) and add nothing to its token. A device-side check would force a host sync
(not graph capturable), so it is not done; `check_ids=True` (debug) verifies on the host.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from ....contract import Manifest, Scope, Variant, float_experts, kernel_spec, register
from ....plan import EXPERTS
from ....quant.mxfp4 import BLOCK as MX_BLOCK
from ....quant.mxfp4 import MXFP4Tensor
from . import tuning
from .common import e8m0_to_f32, tanh_f32

MAX_TOKENS = 16
ACTS = {"silu": 0, "situ": 1}
WDTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}  # names in shape keys
KERNEL = "fused-experts"  # the name of this kernel's tuning files (backends/fused/kernels/tuning.py, `megadecode tune`)
# Block sizes used when the caller passes none and no tuned config exists for (shape, GPU, batch) in
# backends/fused/kernels/configs/fused-experts/<gpu>.json (see backends/fused/kernels/tuning.py). Untuned starting points, only the fallback.
DEFAULT_BLOCKS = {
    "BLOCK_I": 32,    # stage 1: rows of gate (and of up) per program
    "BLOCK_D": 128,   # stage 1: reduction chunk over D (a multiple of 32 for MXFP4)
    "BLOCK_N": 16,    # stage 2: output columns per program (T * D / BLOCK_N programs)
    "BLOCK_K": 128,   # stage 2: reduction chunk over I (a multiple of 32 for MXFP4)
    "num_warps": 4,
    "num_stages": 3,  # software pipelining of the reduction loops (Triton's own default on CUDA)
}


def shape_key(D: int, I: int, A: int, wdtype: str, act: str) -> str:
    """The tuning files' key of a problem shape, e.g. "D=3584,I=3072,A=16,wdtype=mxfp4,act=situ"."""
    return f"D={D},I={I},A={A},wdtype={wdtype},act={act}"


def _device_name(device: torch.device) -> str | None:
    """The GPU's name for the tuning files on CUDA; None elsewhere (no tuned configs there)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def tuned_blocks(device: torch.device, key: str, T: int) -> dict | None:
    """The tuned config for (GPU of `device`, shape `key`, batch T), or None (use DEFAULT_BLOCKS)."""
    name = _device_name(device)
    return None if name is None else tuning.lookup(KERNEL, name, key, T)


@triton.jit
def _e2m1_lo(b):
    """The low nibbles of bytes b (int32) as fp32 e2m1 values times 2**-14, in four integer ops and a
    conversion: the code's bits moved into an fp16 (sign to bit 15, the 2 exponent and 1 mantissa bits to
    bits 11..9). Exact: fp16 with exponent field e is 2**(e-15) (1 + m/2) = 2**-14 * e2m1, the subnormal
    0.5 included (fp16 subnormal 512/1024 * 2**-14). Callers multiply their sums by 2**14 (exact)."""
    bits = ((b & 8) << 12) | ((b & 7) << 9)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e2m1_hi(b):
    """The high nibbles of bytes b, as _e2m1_lo (times 2**-14)."""
    bits = ((b & 0x80) << 8) | ((b & 0x70) << 5)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _rows_dot(w_ptr, s_ptr, w_off, s_off, rows, row_ok, stride_wr, stride_sr, v_ptr, K: tl.constexpr,
              BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, MXFP4: tl.constexpr):
    """[BLOCK_R] fp32: W[rows, :K] . v[:K] for one expert's matrix starting at w_ptr + w_off (row stride
    stride_wr). MXFP4: W holds K/2 bytes per row and s_ptr + s_off K/32 e8m0 scales (row stride stride_sr).
    v (an activation) is read with plain loads; W with evict_first (streamed once per pair)."""
    if MXFP4:
        HALF: tl.constexpr = BLOCK_K // 2
        NB: tl.constexpr = BLOCK_K // 32
        acc = tl.zeros((BLOCK_R, NB), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            j = k0 // 2 + tl.arange(0, HALF)  # byte index in the row
            j_ok = j < K // 2
            m = row_ok[:, None] & j_ok[None, :]
            b = tl.load(w_ptr + w_off + rows[:, None] * stride_wr + j[None, :], mask=m, other=0,
                        eviction_policy="evict_first").to(tl.int32)
            ve = tl.load(v_ptr + 2 * j, mask=j_ok, other=0.0).to(tl.float32)
            vo = tl.load(v_ptr + 2 * j + 1, mask=j_ok, other=0.0).to(tl.float32)
            prod = _e2m1_lo(b) * ve[None, :] + _e2m1_hi(b) * vo[None, :]  # [BLOCK_R, HALF], x 2**-14
            part = tl.sum(tl.reshape(prod, (BLOCK_R, NB, 16)), axis=2)  # per 32-weight block
            sb = k0 // 32 + tl.arange(0, NB)
            sc = tl.load(s_ptr + s_off + rows[:, None] * stride_sr + sb[None, :],
                         mask=row_ok[:, None] & (sb < K // 32)[None, :], other=127,
                         eviction_policy="evict_first").to(tl.int32)
            acc += part * e8m0_to_f32(sc)
        return tl.sum(acc, axis=1) * 16384.0  # undo the decoders' 2**-14
    else:
        acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            v = tl.load(v_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + w_off + rows[:, None] * stride_wr + k[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0,
                        eviction_policy="evict_first").to(tl.float32)
            acc += w * v[None, :]
        return tl.sum(acc, axis=1)


@triton.jit
def experts_up_kernel(x_ptr, ids_ptr, gu_ptr, gus_ptr, h_ptr, stride_x, stride_gu_e, stride_gu_r,
                      stride_gus_e, stride_gus_r, D: tl.constexpr, I: tl.constexpr,
                      A: tl.constexpr, ACT: tl.constexpr, MXFP4: tl.constexpr,
                      BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (p, i-tile): h[p, i] = act(gate_e[i] . x_t, up_e[i] . x_t), e = ids[p], t = p // A."""
    p = tl.program_id(0)
    t = p // A
    e = tl.load(ids_ptr + p).to(tl.int64)
    live = e >= 0  # a skipped pair (expert parallelism) loads no weights: g = u = 0, h = 0
    e = tl.maximum(e, 0)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    i_ok = i < I
    w_off = e * stride_gu_e
    s_off = e * stride_gus_e
    x_row = x_ptr + t * stride_x
    g = _rows_dot(gu_ptr, gus_ptr, w_off, s_off, i, i_ok & live, stride_gu_r, stride_gus_r, x_row, D,
                  BLOCK_I, BLOCK_D, MXFP4)
    u = _rows_dot(gu_ptr, gus_ptr, w_off, s_off, I + i, i_ok & live, stride_gu_r, stride_gus_r, x_row, D,
                  BLOCK_I, BLOCK_D, MXFP4)
    sig = 1.0 / (1.0 + tl.exp(-g))
    if ACT == 0:  # SiLU-GLU
        h = g * sig * u
    else:  # SiTU-GLU: 4 tanh(g/4) sigmoid(g) * 25 tanh(u/25)
        h = 4.0 * tanh_f32(g * 0.25) * sig * (25.0 * tanh_f32(u * 0.04))
    tl.store(h_ptr + p.to(tl.int64) * I + i, h, mask=i_ok)


@triton.jit
def experts_down_kernel(h_ptr, ids_ptr, wts_ptr, dn_ptr, dns_ptr, out_ptr, stride_out, stride_dn_e,
                        stride_dn_r, stride_dns_e, stride_dns_r, D: tl.constexpr, I: tl.constexpr,
                        A: tl.constexpr, MXFP4: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (t, n-tile): out[t, n] = sum_{a = 0..A-1, in order} w[t, a] * down_e[n, :] . h[t*A + a, :]
    (a skipped pair, id < 0, loads no weights and adds 0)."""
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < D
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for a in range(A):
        p = t * A + a
        e = tl.load(ids_ptr + p).to(tl.int64)
        live = e >= 0
        e = tl.maximum(e, 0)
        w = tl.load(wts_ptr + p).to(tl.float32)
        y = _rows_dot(dn_ptr, dns_ptr, e * stride_dn_e, e * stride_dns_e, n, n_ok & live, stride_dn_r,
                      stride_dns_r, h_ptr + p.to(tl.int64) * I, I, BLOCK_N, BLOCK_K, MXFP4)
        acc += w * y
    tl.store(out_ptr + t * stride_out + n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


# ---- launcher -----------------------------------------------------------------------------------------
def _as_weight(name: str, w):
    """-> (tensor, scale or None, logical shape). Accepts a float tensor, an MXFP4Tensor or (packed, scale)."""
    if isinstance(w, tuple):
        w = MXFP4Tensor(*w)
    if isinstance(w, MXFP4Tensor):
        p, s = w.packed, w.scales
        if p.dim() != 3:
            raise ValueError(f"{name}: MXFP4 packed must be [E, out, in/2], got {tuple(p.shape)}")
        if not (p.is_contiguous() and s.is_contiguous()):
            raise ValueError(f"{name}: MXFP4 packed and scales must be contiguous")
        return p, s, tuple(w.shape)
    if not isinstance(w, torch.Tensor) or w.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{name}: expected a float tensor, an MXFP4Tensor or (packed, scale), got "
                         f"{getattr(w, 'dtype', type(w).__name__)}")
    if w.dim() != 3 or w.stride(2) != 1:
        raise ValueError(f"{name}: expected [E, out, in] with unit stride over `in`, got shape {tuple(w.shape)} "
                         f"strides {w.stride()}")
    return w, None, tuple(w.shape)


def check_problem(x, ids, weights, gate_up, down, act, out, max_tokens: int | None,
                  check_ids: bool) -> SimpleNamespace:
    """Validate a routed-experts call (shared by the fused and the grouped launchers); -> a namespace with
    T, D, A, E, I, mx, gu, gus, dn, dns and out (allocated when None). ValueError naming what is wrong."""
    if act not in ACTS:
        raise ValueError(f"act must be one of {sorted(ACTS)}, got {act!r}")
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x must be a float tensor (fp32/fp16/bf16), got {getattr(x, 'dtype', type(x))}")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, D] with unit stride over D, got shape {tuple(x.shape)} strides {x.stride()}")
    T, D = x.shape
    if max_tokens is not None and T > max_tokens:
        raise ValueError(f"fused_experts handles batch <= {max_tokens} (got T={T}): for larger batches use the "
                         "grouped path (megadecode.backends.fused.kernels.grouped_experts.grouped_experts, or "
                         "routed_experts, which picks the path by batch)")
    if ids.dim() != 2 or ids.shape[0] != T or ids.dtype not in (torch.int64, torch.int32) or not ids.is_contiguous():
        raise ValueError(f"ids must be contiguous [T={T}, A] int64/int32, got {tuple(ids.shape)} {ids.dtype}")
    A = ids.shape[1]
    if weights.shape != ids.shape or weights.dtype != torch.float32 or not weights.is_contiguous():
        raise ValueError(f"weights must be contiguous [T, A]={tuple(ids.shape)} fp32, got {tuple(weights.shape)} "
                         f"{weights.dtype}")
    gu, gus, gu_shape = _as_weight("gate_up", gate_up)
    dn, dns, dn_shape = _as_weight("down", down)
    mx = gus is not None
    if (dns is not None) != mx:
        raise ValueError("gate_up and down must both be float or both be MXFP4")
    E, two_i, gu_in = gu_shape
    I = two_i // 2
    if two_i % 2 or gu_in != D or dn_shape != (E, D, I):
        raise ValueError(f"gate_up {gu_shape} must be [E, 2I, D={D}] and down {dn_shape} [E, D={D}, I]")
    if not mx and gu.dtype != dn.dtype:
        raise ValueError(f"gate_up ({gu.dtype}) and down ({dn.dtype}) must share a dtype")
    if mx and (D % MX_BLOCK or I % MX_BLOCK):
        raise ValueError(f"MXFP4 experts need D ({D}) and I ({I}) to be multiples of {MX_BLOCK}")
    if A > E:
        raise ValueError(f"A ({A}) active experts per token exceeds E ({E})")
    if check_ids and T and (int(ids.min()) < -1 or int(ids.max()) >= E):
        raise ValueError(f"ids out of range [-1, {E}) (-1: skip the pair): min {int(ids.min())}, "
                         f"max {int(ids.max())}")
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if out.shape != (T, D) or out.dtype not in (x.dtype, torch.float32) or out.stride(1) != 1:
        raise ValueError(f"out must be [T, D]=({T}, {D}) {x.dtype} (or float32) with unit stride over D, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    devs = {t.device for t in (x, ids, weights, gu, dn, out)}
    if len(devs) != 1:
        raise ValueError(f"all tensors must be on one device, got {devs}")
    return SimpleNamespace(T=T, D=D, A=A, E=E, I=I, mx=mx, gu=gu, gus=gus, dn=dn, dns=dns, out=out)


def fused_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up, down, *,
                  act: str = "silu", out: torch.Tensor | None = None, scratch: torch.Tensor | None = None,
                  check_ids: bool = False, blocks: dict | None = None) -> torch.Tensor:
    """Routed experts for T <= 16 tokens: x [T, D] float, ids [T, A] int64/int32 (0 <= ids < E, the router's
    contract, or -1 to skip a pair; checked on the host only with check_ids=True), weights [T, A] fp32; gate_up [E, 2I, D] and
    down [E, D, I] as float tensors, or as MXFP4 (an MXFP4Tensor or a (packed uint8 [E, out, in/2], scale
    uint8 [E, out, in/32]) tuple; D and I multiples of 32). act: "silu" (SwiGLU) or "situ" (SiTU-GLU).
    Writes and returns out [T, D] (x.dtype, or float32 when `out` is given so: the fp32 sums unrounded; every
    element written). `scratch`: optional fp32 [T*A, I]
    buffer for h. `blocks`: overrides of DEFAULT_BLOCKS; None: the tuned config for this shape, batch and GPU
    (backends/fused/kernels/tuning.py lookup, CUDA only) when one exists."""
    pb = check_problem(x, ids, weights, gate_up, down, act, out, MAX_TOKENS, check_ids)
    T, D, A, I, mx, out = pb.T, pb.D, pb.A, pb.I, pb.mx, pb.out
    gu, gus, dn, dns = pb.gu, pb.gus, pb.dn, pb.dns
    if scratch is None:
        scratch = torch.empty(T * A, I, dtype=torch.float32, device=x.device)
    if scratch.shape != (T * A, I) or scratch.dtype != torch.float32 or not scratch.is_contiguous():
        raise ValueError(f"scratch must be contiguous [T*A, I]=({T * A}, {I}) fp32")
    if scratch.device != x.device:
        raise ValueError(f"scratch is on {scratch.device}, x on {x.device}")
    if T == 0:
        return out
    if blocks is None:
        wdtype = "mxfp4" if mx else WDTYPES[gu.dtype]
        blocks = tuned_blocks(x.device, shape_key(D, I, A, wdtype, act), T)
    b = {**DEFAULT_BLOCKS, **(blocks or {})}
    bi = min(b["BLOCK_I"], triton.next_power_of_2(I))
    bd = min(b["BLOCK_D"], max(MX_BLOCK, triton.next_power_of_2(D)))
    bn = min(b["BLOCK_N"], triton.next_power_of_2(D))
    bk = min(b["BLOCK_K"], max(MX_BLOCK, triton.next_power_of_2(I)))
    if mx and (bd % MX_BLOCK or bk % MX_BLOCK):
        raise ValueError(f"MXFP4 reduction blocks must be multiples of {MX_BLOCK}: BLOCK_D={bd}, BLOCK_K={bk}")
    gus_, dns_ = (gus, dns) if mx else (gu, dn)  # unused scale pointers: any valid tensor
    experts_up_kernel[(T * A, triton.cdiv(I, bi))](
        x, ids, gu, gus_, scratch, x.stride(0), gu.stride(0), gu.stride(1),
        gus_.stride(0) if mx else 0, gus_.stride(1) if mx else 0, D=D, I=I,
        A=A, ACT=ACTS[act], MXFP4=mx, BLOCK_I=bi, BLOCK_D=bd, num_warps=b["num_warps"],
        num_stages=b["num_stages"])
    experts_down_kernel[(T, triton.cdiv(D, bn))](
        scratch, ids, weights, dn, dns_, out, out.stride(0), dn.stride(0), dn.stride(1),
        dns_.stride(0) if mx else 0, dns_.stride(1) if mx else 0, D=D, I=I,
        A=A, MXFP4=mx, BLOCK_N=bn, BLOCK_K=bk, num_warps=b["num_warps"],
        num_stages=b["num_stages"])
    return out


def tuning_key(D: int, I: int, A: int, wdtype: str, act: str, T: int) -> str:
    """The tuning-file key this launcher looks up at batch T (`megadecode tune`)."""
    return shape_key(D, I, A, wdtype, act)


def launch(x, ids, w, gu, dn, act, out, blocks):
    """The tuner's entry point: one call with explicit blocks."""
    return fused_experts(x, ids, w, gu, dn, act=act, out=out, blocks=blocks)


# ---- static audit description -------------------------------------------------------------------------
def audit_specs(dtype: str = "bf16", mxfp4: bool = False, act: str = "silu", D: int = 7168, I: int = 2048,
                A: int = 8) -> list:
    """(kernel, signature, roles, constexprs) for both stages, for megadecode.validate.audit.audit_kernel:
    activations (x, ids, router weights, h, out) are "produced", expert weights "static"."""
    w = "*u8" if mxfp4 else f"*{dtype}"
    s = "*u8" if mxfp4 else f"*{dtype}"
    b = DEFAULT_BLOCKS
    up_sig = {"x_ptr": f"*{dtype}", "ids_ptr": "*i64", "gu_ptr": w, "gus_ptr": s, "h_ptr": "*fp32",
              "stride_x": "i32", "stride_gu_e": "i32", "stride_gu_r": "i32", "stride_gus_e": "i32",
              "stride_gus_r": "i32"}
    up_c = {"D": D, "I": I, "A": A, "ACT": ACTS[act], "MXFP4": mxfp4, "BLOCK_I": b["BLOCK_I"], "BLOCK_D": b["BLOCK_D"]}
    dn_sig = {"h_ptr": "*fp32", "ids_ptr": "*i64", "wts_ptr": "*fp32", "dn_ptr": w, "dns_ptr": s,
              "out_ptr": f"*{dtype}", "stride_out": "i32", "stride_dn_e": "i32", "stride_dn_r": "i32",
              "stride_dns_e": "i32", "stride_dns_r": "i32"}
    dn_c = {"D": D, "I": I, "A": A, "MXFP4": mxfp4, "BLOCK_N": b["BLOCK_N"], "BLOCK_K": b["BLOCK_K"]}
    return [kernel_spec(experts_up_kernel, up_sig, up_c, static=("gu_ptr", "gus_ptr"), path=("MXFP4", "ACT")),
            kernel_spec(experts_down_kernel, dn_sig, dn_c, static=("dn_ptr", "dns_ptr"))]


# ---- the harness variant ----------------------------------------------------------------------------
def _run(op, inputs, weights, outputs, cfg, step, cache=None):
    x, ids, wts = (inputs[n] for n in op.inputs)
    fused_experts(x.contiguous(), ids.contiguous(), wts.float().contiguous(), weights[op.weights[0]],
                  weights[op.weights[1]], act="silu", out=outputs[op.outputs[0]])


FUSED_EXPERTS_VARIANT = register(Variant(Manifest(
    name="triton-fused-experts",
    description="routed experts for batch <= 16 in two Triton kernels without a sort pass: (pair, I-tile) "
                "programs write act(gate.x, up.x) to a fp32 scratch, (token, D-tile) programs sum the A "
                "down-projections in a fixed order; fp32 math, float or MXFP4 weights",
    replaces=(EXPERTS,),
    scope=Scope(families=("qwen3_moe", "deepseek_v3"), dtypes=("float32", "float16", "bfloat16"),
                devices=("cpu", "cuda"), batch=(1, MAX_TOKENS), arch="sm_90", dims=float_experts),
    sources=("megadecode/backends/fused/kernels/fused_experts.py", "megadecode/backends/fused/kernels/common.py"), uses_triton=True,
    graph_capturable=True,
    kernels=lambda: audit_specs(act="silu", D=2048, I=768)),
    _run, kernel=experts_up_kernel))
