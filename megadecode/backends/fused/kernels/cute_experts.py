"""MXFP4 routed experts on tensor cores in CuTe DSL (issue 14, item 1): the weights are read in the order the
inner loop wants them (quant/mxfp4_frag.py: each lane's 16-byte load is its own mma.sync A fragments, the block
scales beside them), decoded in registers straight into those fragments, and multiplied on the tensor cores.

    out[t] = sum_a w[t, a] * down_e (act(gate_e x_t, up_e x_t)),   e = ids[t, a]

Legend as backends/fused/kernels/fused_experts.py (T tokens, A active experts, E experts, D hidden, I intermediate; a pair
p = t * A + a). Three launches, no host sync (graph capturable):
  1. up    grid (units, gy): a unit is one pair (<= GROUPED_ABOVE tokens: no sort) or one expert with its pairs
           (above: pairs sorted by expert on the device, backends/fused/kernels/grouped_experts.group_pairs). The CTA stages the
           unit's activations in shared memory as fp16 (times a per-token power of two that puts the row's max in
           [2**14, 2**15); with SPLIT a second fp16 plane holds the remainders, ~22 bits in all), NTOK tokens at a
           time; each warp takes 16-row tiles of gate and the matching tiles of up, streams their records over D
           and writes h[p, i] = act(gate . x, up . x) in fp32.
  2. down  the same units over h (each pair's row scaled alike): y[p, n] = down_e[n] . h[p], fp32.
  3. combine (backends/fused/kernels/grouped_experts.combine_kernel): out[t] = sum_a w[t, a] y[t*A + a] in a fixed order.
Per 16-byte weight load a lane holds 4 k-steps of one tile: each word becomes the 4 A registers of one
m16n8k16 (11 shifts and masks a word: e2m1 * 2**-14 in fp16, exact), the activations' B registers come
from one 16-byte shared-memory load per 32-weight block and plane, an mma per k-step and plane sums into a
block accumulator that the block's e8m0 scale (a shift into fp32's exponent) multiplies into the tile's.

Exactness: the weight decode is exact for every code and every scale byte but 0 (read as 0, not 2**-127: a block
of weights below 3.6e-38) and 255 (refused when the weights are re-laid out). Activations enter as fp16 of the
scaled value (exact for bf16 / fp16 inputs whose magnitude is within 2**24 of their row's max; fp32 inputs keep
~11 bits, ~22 with SPLIT); products and sums are the tensor cores' fp32. h enters the down products likewise
(per pair scale). Deterministic: no atomics, each output element from one warp, a fixed order.

Memory paths: the records are static weights and are read with `ld.global.nc.L1::no_allocate` (the only
non-coherent loads); x, ids, order, offs, h are produced during a step and read with plain `ld.global`; the
static audit (tests/test_cute_experts.py) checks the compiled PTX.
"""


import functools
import tempfile

import torch

from ....quant.mxfp4 import MXFP4Tensor
from ....quant.mxfp4_frag import (KREC, RECORD, TILE, WBYTES, MXFP4Frag, frag_from_entries, is_frag_entry,
                                  relayout_experts)

GROUPED_ABOVE = 16  # tokens: per pair at or below (no sort), grouped by expert above
ACTS = ("silu", "situ")
XDTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# ntok: tokens staged per chunk when grouped; tpw / tpw_grouped: 16-row tiles per warp (the grid's second dim);
# scu / scu_grouped: records of a tile loaded before the first is used; wpc / wpc_grouped: warps per CTA. Defaults: the fastest in bench/cute_experts_probe.py on the H200 (docs/evidence/
# cute-experts-h200.md)
DEFAULT_TUNE = {"ntok": 8, "tpw": 1, "tpw_grouped": 2, "scu": 1, "scu_grouped": 2, "wpc": 4, "wpc_grouped": 8}
MAX_CHUNK = 256  # tokens a cute_experts call in cute_latent_moe (the variant's validated batch range)


@functools.lru_cache(maxsize=32)
def _build(up: bool, K: int, R: int, A: int, ntok: int, split: bool, act: str, grouped: bool, xdt: str,
           scu: int = 1, wpc: int = 4):
    """The compiled launcher for one configuration (cute.compile; PTX in `.__ptx__`). The staged activations:
    (ntok + 1 zero row) x planes rows of K/2 + 16 words (a 64-byte pad: a row starts 64 bytes off the 128-byte
    bank period, so lanes g and g + 1 of a quarter warp miss each other's banks)."""
    from ...cute_device import ARCH  # sets the DSL's architecture before cutlass is imported

    import cuda.bindings.driver as cuda_drv
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float16, Float32, Int32, Int64, Uint32
    from cutlass.memory import SmemAllocator

    from ...cute_device import from_bits, ldi, ldi64, silu, situ, stf, warp_max
    from ...cute_frag import frag_block, lds4

    XT = {"fp32": Float32, "bf16": BFloat16, "fp16": Float16}[xdt]
    XB = XT.width // 8
    NSC = K // KREC
    SW = K // 2 + 16
    PL = 2 if split else 1
    ROWS = ntok + 1
    NTILE = R // (2 * TILE) if up else R // TILE  # up: gate tiles (the up tiles are NTILE further)
    ROWS_OUT = R // 2 if up else R  # elements per output row (h: I, y: D)
    WPC = wpc
    NTHR = 32 * WPC
    NTL = 2 if up else 1  # tiles a warp streams at once (up: gate and up)
    SCU = scu  # records of each tile loaded before the first is used
    assert ntok <= 8 and NSC % SCU == 0 and K % KREC == 0 and R % (2 * TILE if up else TILE) == 0

    @cute.jit
    def ldg4(addr: Int64):
        return cute.arch.inline_ptx("ld.global.nc.L1::no_allocate.v4.u32 { {$w0}, {$w1}, {$w2}, {$w3} }, [{$r0}];",
                                    write_only_types=[Uint32, Uint32, Uint32, Uint32], read_only_args=[addr])

    @cute.jit
    def f16x2(lo: Float32, hi: Float32) -> Uint32:
        return cute.arch.inline_ptx("cvt.rn.f16x2.f32 {$w0}, {$r1}, {$r0};", write_only_types=[Uint32],
                                    read_only_args=[lo, hi])

    @cute.jit
    def f16x2_rest(lo: Float32, hi: Float32, h: Uint32) -> Uint32:
        """The fp16 pair of (lo, hi) minus the fp16 pair h of them (exact in fp32), rounded to fp16."""
        return cute.arch.inline_ptx(
            "{ .reg .b16 a, b; .reg .f32 fa, fb; mov.b32 {a, b}, {$r2}; cvt.f32.f16 fa, a; cvt.f32.f16 fb, b; "
            "sub.rn.f32 fa, {$r0}, fa; sub.rn.f32 fb, {$r1}, fb; cvt.rn.f16x2.f32 {$w0}, fb, fa; }",
            write_only_types=[Uint32], read_only_args=[lo, hi, h])

    @cute.jit
    def ld4x(addr: Int64):
        """4 consecutive activations (16-byte aligned fp32, 8-byte 16-bit) as fp32."""
        return cute.make_tensor(cute.make_ptr(XT, addr, cute.AddressSpace.gmem, assumed_align=4 * XB),
                                cute.make_layout(4)).load().to(Float32)

    @cute.jit
    def sts2(addr: Int32, a: Uint32, b: Uint32):
        cute.arch.inline_ptx("st.shared.v2.u32 [{$r0}], { {$r1}, {$r2} };", read_only_args=[addr, a, b])

    @cute.kernel
    def kern(src: Int64, ids: Int64, order: Int64, offs: Int64, wq: Int64, dst: Int64):
        tid, _, _ = cute.arch.thread_idx()
        u, by, _ = cute.arch.block_idx()
        _, gy, _ = cute.arch.grid_dim()
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        c = lane % 4
        alloc = SmemAllocator()
        xs = alloc.allocate_tensor(Uint32, cute.make_layout(PL * ROWS * SW), 16)
        fs = alloc.allocate_tensor(Float32, cute.make_layout(8), 16)
        ps = alloc.allocate_tensor(Int32, cute.make_layout(8), 16)
        red = alloc.allocate_tensor(Float32, cute.make_layout(8), 16)
        xbase = xs.iterator.toint()
        e = Int64(0)
        start = Int32(0)
        n = Int32(0)
        if cutlass.const_expr(grouped):
            e = Int64(u)
            start = ldi(offs + Int64(u) * 4)
            n = ldi(offs + Int64(u + 1) * 4) - start
        else:
            e = ldi64(ids + Int64(u) * 8)
            start = Int32(u)
            n = Int32(1)
            if e < Int64(0):
                n = Int32(0)
        rt0 = by * WPC + warp
        for i in cutlass.range(tid, SW, NTHR):  # the zero rows (B of lanes whose token is past ntok)
            for pl in cutlass.range_constexpr(PL):
                xs[(pl * ROWS + ntok) * SW + i] = Uint32(0)
        brow = cutlass.min(g, Int32(ntok))
        acc = cute.make_rmem_tensor(8, Float32)
        for ch in cutlass.range(0, n, ntok):
            nv = cutlass.min(Int32(ntok), n - ch)
            for r in cutlass.range(ntok):
                cute.arch.sync_threads()  # the previous chunk's readers (and red's) are done
                if r < nv:
                    pair = start + ch + r
                    if cutlass.const_expr(grouped):
                        pair = ldi(order + Int64(start + ch + r) * 4)
                    row = Int64(pair)
                    if cutlass.const_expr(up):
                        row = Int64(pair // A)
                    xrow = src + row * Int64(K * XB)
                    m = Float32(0.0)
                    for k4 in cutlass.range(tid, K // 4, NTHR):
                        v = ld4x(xrow + Int64(4 * k4 * XB))
                        for j in cutlass.range_constexpr(4):
                            m = cute.arch.fmax(m, cute.arch.fmax(v[j], -v[j]))
                    m = warp_max(m)
                    if lane == 0:
                        red[warp] = m
                    cute.arch.sync_threads()
                    m = red[0]
                    for w in cutlass.range_constexpr(1, WPC):
                        m = cute.arch.fmax(m, red[w])
                    ex = (Int32(cute.arch.inline_ptx("mov.b32 {$w0}, {$r0};", write_only_types=[Int32],
                                                     read_only_args=[m])) >> 23) & 255
                    kk = Int32(0)  # x * 2**kk has its row max in [2**14, 2**15); 0 for an all-zero or non-finite row
                    if ex > 0 and ex < 255:
                        kk = cutlass.min(Int32(141) - ex, Int32(127))
                    up_s = from_bits(Uint32((kk + 127) << 23))
                    for k4 in cutlass.range(tid, K // 4, NTHR):
                        v = ld4x(xrow + Int64(4 * k4 * XB))
                        v0, v1, v2, v3 = v[0] * up_s, v[1] * up_s, v[2] * up_s, v[3] * up_s
                        h0 = f16x2(v0, v1)
                        h1 = f16x2(v2, v3)
                        sts2(xbase + Int32(4 * (r * SW + 2 * k4)), h0, h1)
                        if cutlass.const_expr(split):
                            sts2(xbase + Int32(4 * ((ROWS + r) * SW + 2 * k4)), f16x2_rest(v0, v1, h0),
                                 f16x2_rest(v2, v3, h1))
                    if tid == 0:
                        fs[r] = from_bits(Uint32((141 - kk) << 23))  # 2**(14 - kk): the decode's 2**-14, x's 2**kk
                        ps[r] = pair
                else:
                    for i in cutlass.range(tid, SW, NTHR):
                        for pl in cutlass.range_constexpr(PL):
                            xs[(pl * ROWS + r) * SW + i] = Uint32(0)
            cute.arch.sync_threads()
            for rt in cutlass.range(rt0, NTILE, gy * WPC):
                for i in cutlass.range_constexpr(8):
                    acc[i] = Float32(0.0)
                recs = [wq + ((e * Int64(R // TILE) + Int64(rt + t * NTILE)) * Int64(NSC)) * Int64(RECORD)
                        for t in range(NTL)]
                for sc0 in cutlass.range(0, NSC, SCU):
                    ws, ss = [], []
                    for su in cutlass.range_constexpr(SCU):
                        for t in cutlass.range_constexpr(NTL):
                            rec = recs[t] + Int64(sc0 + su) * Int64(RECORD)
                            ws.append([ldg4(rec + Int64(512 * q) + Int64(16 * lane)) for q in range(4)])
                            ss.append(ldg4(rec + Int64(WBYTES) + Int64(16 * g)))
                    for su in cutlass.range_constexpr(SCU):
                        sc = sc0 + su
                        for q in cutlass.range_constexpr(4):
                            for b in cutlass.range_constexpr(2):
                                off = 4 * (128 * sc + 32 * q + 16 * b + 4 * c)
                                bh = lds4(xbase + Int32(4 * brow * SW) + Int32(off))
                                bl = None
                                if cutlass.const_expr(split):
                                    bl = lds4(xbase + Int32(4 * (ROWS + brow) * SW) + Int32(off))
                                for t in cutlass.range_constexpr(NTL):
                                    frag_block(acc, t, ws[su * NTL + t][q][2 * b:2 * b + 2], ss[su * NTL + t],
                                               2 * q + b, bh, bl)
                for i in cutlass.range_constexpr(4):
                    col = 2 * c + (i % 2)
                    if col < nv:
                        f = fs[col]
                        orow = rt * TILE + g + 8 * (i // 2)
                        val = acc[i] * f
                        if cutlass.const_expr(up):
                            uval = acc[4 + i] * f
                            if cutlass.const_expr(act == "situ"):
                                val = situ(val, uval)
                            else:
                                val = silu(val) * uval
                        stf(Float32, dst + (Int64(ps[col]) * Int64(ROWS_OUT) + Int64(orow)) * 4, val)

    @cute.jit
    def launch(src: Int64, ids: Int64, order: Int64, offs: Int64, wq: Int64, dst: Int64, units: Int32, gy: Int32,
               stream: cuda_drv.CUstream):
        kern(src, ids, order, offs, wq, dst).launch(grid=(units, gy, 1), block=(NTHR, 1, 1), stream=stream)

    dump = tempfile.mkdtemp(prefix="megadecode-cute-experts-")
    return cute.compile(launch, Int64(0), Int64(0), Int64(0), Int64(0), Int64(0), Int64(0), Int32(1), Int32(1),
                        cuda_drv.CUstream(0), options=f"--gpu-arch={ARCH} --keep-ptx --keep-cubin --dump-dir={dump}",
                        no_cache=True)


# ---- launcher -----------------------------------------------------------------------------------------
def _stream():
    import cuda.bindings.driver as cuda_drv

    return cuda_drv.CUstream(torch.cuda.current_stream().cuda_stream)


def _scu(scu: int, K: int) -> int:
    """Records a loop trip: `scu` where it divides the K / 256 records of a tile, else 1."""
    return scu if (K // KREC) % scu == 0 else 1


def check_frag_problem(x, ids, weights, gate_up, down, act, out):
    """Shapes, dtypes and devices of a cute_experts call, or a ValueError naming what is wrong."""
    if act not in ACTS:
        raise ValueError(f"act must be one of {ACTS}, got {act!r}")
    for name, w in (("gate_up", gate_up), ("down", down)):
        if not isinstance(w, MXFP4Frag):
            raise ValueError(f"{name} must be an MXFP4Frag (quant/mxfp4_frag.relayout), got {type(w).__name__}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in XDTYPES:
        raise ValueError(f"x must be [T, D] fp32/bf16/fp16, got {getattr(x, 'dtype', type(x).__name__)} "
                         f"{tuple(getattr(x, 'shape', ()))}")
    T, D = x.shape
    E, I2, D2 = gate_up.shape
    E2, D3, I = down.shape
    if D2 != D or D3 != D or E2 != E or I2 != 2 * I:
        raise ValueError(f"expert shapes disagree: x [{T}, {D}], gate_up {tuple(gate_up.shape)} (want [E, 2I, D]), "
                         f"down {tuple(down.shape)} (want [E, D, I])")
    if ids.dim() != 2 or ids.shape[0] != T or ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"ids must be [T, A] int64/int32 with T = {T}, got {ids.dtype} {tuple(ids.shape)}")
    if weights.shape != ids.shape or weights.dtype != torch.float32:
        raise ValueError(f"weights must be fp32 {tuple(ids.shape)}, got {weights.dtype} {tuple(weights.shape)}")
    if out is not None and (out.shape != (T, D) or out.stride(1) != 1):
        raise ValueError(f"out must be [{T}, {D}] with unit column stride, got {tuple(out.shape)}")
    devs = {t.device for t in (x, ids, weights, gate_up.data, down.data) + ((out,) if out is not None else ())}
    if len(devs) != 1 or next(iter(devs)).type != "cuda":
        raise ValueError(f"cute_experts runs on one CUDA device, got {devs}")
    return T, D, ids.shape[1], E, I


def cute_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: MXFP4Frag, down: MXFP4Frag, *,
                 act: str = "situ", out: torch.Tensor | None = None, grouped: bool | None = None,
                 split: bool | None = None, tune: dict | None = None,
                 stages: tuple[str, ...] = ("up", "down", "combine")) -> torch.Tensor:
    """Routed experts with fragment-ordered MXFP4 weights (the module doc). x [T, D] fp32/bf16/fp16, ids [T, A]
    (0 <= id < E, or -1: a pair to skip), weights [T, A] fp32. grouped: sort the pairs by expert (default above
    GROUPED_ABOVE tokens); split: a second fp16 plane for the activations' remainders (default for fp32 x);
    tune: overrides of DEFAULT_TUNE; stages: the launches to make (all: a subset only times one, bench/
    cute_experts_probe.py). Writes and returns out [T, D] (x.dtype unless `out` is
    given)."""
    from .grouped_experts import BLOCK_C, combine_kernel, group_pairs

    T, D, A, E, I = check_frag_problem(x, ids, weights, gate_up, down, act, out)
    if out is None:
        out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    x = x.contiguous()
    ids = ids.contiguous()
    grouped = T > GROUPED_ABOVE if grouped is None else grouped
    split = x.dtype == torch.float32 if split is None else split
    kn = {**DEFAULT_TUNE, **(tune or {})}
    unknown = set(kn) - set(DEFAULT_TUNE)
    if unknown:
        raise ValueError(f"unknown tune keys {sorted(unknown)}; keys: {sorted(DEFAULT_TUNE)}")
    ntok = kn["ntok"] if grouped else 1
    P = T * A
    ids64 = ids if ids.dtype == torch.int64 else ids.to(torch.int64)
    if grouped:
        order, offs = group_pairs(ids64, E)
        units = E
    else:
        order = offs = ids64  # unused
        units = P
    h = torch.empty(P, I, dtype=torch.float32, device=x.device)
    y = torch.empty(P, D, dtype=torch.float32, device=x.device)
    tpw = kn["tpw_grouped"] if grouped else kn["tpw"]
    scu = kn["scu_grouped"] if grouped else kn["scu"]
    wpc = kn["wpc_grouped"] if grouped else kn["wpc"]
    g_up, g_dn = -(-I // (TILE * wpc * tpw)), -(-D // (TILE * wpc * tpw))
    upk = _build(True, D, 2 * I, A, ntok, split, act, grouped, XDTYPES[x.dtype], _scu(scu, D), wpc)
    dnk = _build(False, I, D, A, ntok, split, "silu", grouped, "fp32", _scu(scu, I), wpc)
    from cutlass import Int32, Int64

    st = _stream()
    p = (Int64(ids64.data_ptr()), Int64(order.data_ptr()), Int64(offs.data_ptr()))
    if "up" in stages:
        upk(Int64(x.data_ptr()), *p, Int64(gate_up.data.data_ptr()), Int64(h.data_ptr()), Int32(units), Int32(g_up),
            st)
    if "down" in stages:
        dnk(Int64(h.data_ptr()), *p, Int64(down.data.data_ptr()), Int64(y.data_ptr()), Int32(units), Int32(g_dn), st)
    if "combine" in stages:
        combine_kernel[(T, -(-D // BLOCK_C))](y, ids, weights, out, out.stride(0), D=D, A=A, BLOCK_C=BLOCK_C)
    return out


_FRAGS: dict[tuple, MXFP4Frag] = {}  # (packed, scales data_ptr, shape) -> its fragment-ordered copy


def frag_of(w) -> MXFP4Frag:
    """The fragment-ordered copy of a stacked MXFP4 weight held in the checkpoint's order, re-laid out on first use
    and kept while the weight lives (the first use must come before a CUDA graph capture). For callers that keep
    the checkpoint's order (the harness, bench_moe): the copy costs the experts' bytes once more. The executors
    hold one order or the other instead (backends/expert_layout.py)."""
    import weakref

    if isinstance(w, MXFP4Frag):
        return w
    if not isinstance(w, MXFP4Tensor):
        w = MXFP4Tensor(*w)
    key = (w.packed.data_ptr(), w.scales.data_ptr(), tuple(w.shape))
    hit = _FRAGS.get(key)
    if hit is None:
        if w.packed.is_cuda and torch.cuda.is_current_stream_capturing():
            raise ValueError("an MXFP4 weight met for the first time during a CUDA graph capture: run the step once "
                             "before capturing (the re-layout allocates and copies)")
        hit = _FRAGS[key] = relayout_experts(w)
        weakref.finalize(w.packed, _FRAGS.pop, key, None)
    return hit


# ---- static audit description -------------------------------------------------------------------------
AUDIT_PARAMS = ("src", "ids", "order", "offs", "wq", "dst")
AUDIT_ROLES = {"src": "produced", "ids": "produced", "order": "produced", "offs": "produced", "wq": "static",
               "dst": "produced"}


class CuteExpertsSpec:
    """One compiled configuration of the kernel for the static audit (contract/kernels.py's interface): the
    records (`wq`) are the only static pointer, everything else is produced during the step."""

    def __init__(self, up: bool, K: int, R: int, grouped: bool, split: bool, act: str = "situ", xdt: str = "fp32"):
        self.cfg = (bool(up), int(K), int(R), bool(grouped), bool(split), act, xdt)
        self.path = ("up", "grouped", "split")

    @property
    def name(self) -> str:
        return f"cute_experts_{'up' if self.cfg[0] else 'down'}"

    @property
    def kernel_id(self) -> str:
        return "megadecode.backends.fused.kernels.cute_experts.kern"

    @property
    def roles(self) -> dict:
        return dict(AUDIT_ROLES)

    def path_values(self) -> dict:
        up, _, _, grouped, split, _, _ = self.cfg
        return {"up": up, "grouped": grouped, "split": split}

    def key(self) -> str:
        import json

        return json.dumps(["cute-experts", *self.cfg])

    def needs_fresh_process(self) -> bool:
        return False

    def portable(self) -> dict:
        return {"kind": "cute-experts", "cfg": list(self.cfg)}

    def compile(self, arch: int = 90):
        from ....contract.kernels import Compiled
        from ...ptxas import assemble

        if arch != 90:
            raise ValueError(f"the CuTe experts kernels are built for sm_90a, not sm_{arch}")
        up, K, R, grouped, split, act, xdt = self.cfg
        t = DEFAULT_TUNE
        ptx = _build(up, K, R, 16, t["ntok"] if grouped else 1, split, act, grouped, xdt,
                     _scu(t["scu_grouped"] if grouped else t["scu"], K),
                     t["wpc_grouped"] if grouped else t["wpc"]).__ptx__
        cubin, _ = assemble(ptx)
        return Compiled(ptx, cubin, list(AUDIT_PARAMS), set(AUDIT_ROLES))


def _register_kind():
    from ....contract.kernels import register_spec_kind

    register_spec_kind("cute-experts", lambda d: CuteExpertsSpec(*d["cfg"]))


_register_kind()


def audit_specs(D: int = 3584, I: int = 3072) -> list:
    """Every configuration the K3 variant launches: up and down, per pair and grouped, with and without the
    remainder plane (fp32 models split, the others not)."""
    return [CuteExpertsSpec(up, D if up else I, 2 * I if up else D, grouped, split, "situ" if up else "silu")
            for up in (True, False) for grouped in (False, True) for split in (False, True)]


# ---- the harness variant ----------------------------------------------------------------------------
def _k3_dims(cfg) -> str | None:
    """latent_size % 256 == 0, moe_intermediate_size % 256 == 0, nvidia-cutlass-dsl importable"""
    R, I = cfg.latent_size, cfg.moe_intermediate_size
    if R % KREC or I % KREC:
        return (f"latent_size {R} and moe_intermediate_size {I} must be multiples of {KREC} (a record's k span); "
                "triton-latent-moe runs the rest")
    try:
        import cutlass  # noqa: F401
    except ImportError:
        return "nvidia-cutlass-dsl is not installed (the `cute` extra)"
    return None


def experts_of(op, weights: dict) -> tuple[MXFP4Frag, MXFP4Frag]:
    """A LATENT_MOE op's routed experts (gate_up, down) in fragment order: the weight-table entries themselves
    where the executor holds them so (backends/expert_layout.py), else frag_of's copy of the checkpoint-order
    ones (the harness and bench_moe pass those)."""
    _, gu_p, gu_s, dn_p, dn_s, _, _ = op.weights
    return tuple(frag_from_entries(weights[p], weights[s]) if is_frag_entry(weights[p])
                 else frag_of(MXFP4Tensor(weights[p], weights[s])) for p, s in ((gu_p, gu_s), (dn_p, dn_s)))


# backends/fused/kernels/linear.py blocks for latent down and up: bench/linear_paths.py on the H200 (K3's 3584 x 7168
# and 7168 x 3584) 17 and 19 us at batch 1 against 26 and 40 us with linear's defaults in the fused step
# (bench/profile_step.py): a 256-wide K step keeps more of the weights in flight. fp32 weights: linear's defaults
# (packed.fit_blocks: these would not fit shared memory)
LATENT_BLOCKS = {"BLOCK_K": 256, "num_stages": 4}


def cute_latent_moe(x, ids, wts, down_w, gate_up: MXFP4Frag, down: MXFP4Frag, norm_w, up_w, *, act: str,
                    eps: float, out: torch.Tensor | None = None, combine=None) -> torch.Tensor:
    """backends/fused/kernels/latent_moe.latent_moe's three stages with these routed experts: h = x latent_down^T (fp32), z =
    the experts (fp32 models with the remainder plane: ~22 bits of the activations; the others 11, fp16),
    [z = combine(z): expert parallelism, ids -1 for the other ranks' pairs], out = (rmsnorm(z) norm_w)
    latent_up^T. Any number of tokens: the experts take MAX_CHUNK of them a call (prefill, decode above 256)."""
    from .linear import linear
    from .packed import fit_blocks

    split = x.dtype == torch.float32
    h = linear(x.contiguous(), down_w, blocks=fit_blocks(LATENT_BLOCKS, down_w, x))
    T = h.shape[0]
    wts = wts.float().contiguous()
    if T <= MAX_CHUNK:
        z = cute_experts(h, ids, wts, gate_up, down, act=act, split=split)
    else:
        z = torch.empty_like(h)
        for t0 in range(0, T, MAX_CHUNK):
            t1 = min(T, t0 + MAX_CHUNK)
            cute_experts(h[t0:t1], ids[t0:t1], wts[t0:t1], gate_up, down, act=act, split=split, out=z[t0:t1])
    if combine is not None:
        z = combine(z)
    return linear(z, up_w, norm_weight=norm_w, eps=eps, out_dtype=x.dtype, out=out,
                  blocks=fit_blocks(LATENT_BLOCKS, up_w, z))


def latent_op(op, x, ids, wts, weights: dict, cfg, out: torch.Tensor | None = None, combine=None) -> torch.Tensor:
    """One LATENT_MOE op by cute_latent_moe, its weights from `weights` (either order: experts_of)."""
    down_w, _, _, _, _, norm_w, up_w = (weights[n] for n in op.weights)
    return cute_latent_moe(x, ids, wts, down_w, *experts_of(op, weights), norm_w, up_w, act=cfg.expert_act,
                           eps=cfg.rms_norm_eps, out=out, combine=combine)


def _run(op, inputs, weights, outputs, cfg, step, cache=None):
    x, ids, wts = (inputs[n] for n in op.inputs)
    latent_op(op, x, ids, wts, weights, cfg, out=outputs[op.outputs[0]])


def _variant_kernels():
    from .grouped_experts import audit_specs as grouped_specs
    from .latent_moe import audit_specs as latent_specs

    linear = [s for s in latent_specs() if s.name == "linear_kernel"]
    combine = [s for s in grouped_specs("fp32", True, "situ") if s.name == "combine_kernel"]
    return linear + combine + audit_specs()


def _register_variant():
    from ....contract import Manifest, Scope, Variant, register
    from ....plan import LATENT_MOE

    return register(Variant(Manifest(
        name="cute-latent-moe",
        description="K3 LatentMoE routed half with the routed MXFP4 experts in CuTe DSL on tensor cores: weights "
                    "re-laid out once in mma.sync fragment order (quant/mxfp4_frag.py), decoded in registers "
                    "straight into the A fragments, block scales applied to each block's fp32 sums; per pair at <= "
                    "16 tokens, grouped by expert above; latent down / up as triton-latent-moe",
        replaces=(LATENT_MOE,),
        scope=Scope(families=("kimi_k3",), dtypes=("float32", "float16", "bfloat16"), devices=("cuda",),
                    batch=(1, 256), arch="sm_90", dims=_k3_dims),
        sources=("megadecode/backends/fused/kernels/cute_experts.py", "megadecode/backends/cute_device.py",
                 "megadecode/quant/mxfp4_frag.py",
                 "megadecode/backends/fused/kernels/linear.py", "megadecode/backends/fused/kernels/packed.py",
                 "megadecode/backends/fused/kernels/grouped_experts.py"), uses_triton=True,
        graph_capturable=True, kernels=_variant_kernels),
        _run))


CUTE_LATENT_MOE_VARIANT = _register_variant()
