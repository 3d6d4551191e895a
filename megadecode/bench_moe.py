"""`megadecode bench --preset k3-moe | qwen3-moe`: the routed experts of one MoE layer alone, per executor's
expert path, against the bytes of the experts the batch selected (issue 5, item 5).

Executors (the expert path each decode executor takes):
  torch  reference loop over the selected experts (reference/moe.py experts_reference for float weights,
         reference/latent_moe.py latent_experts for MXFP4: each selected expert decoded exactly); eager,
         host syncs.
  graph  torch._grouped_mm over expert-sorted pairs (reference/moe.py experts_grouped; SiLU- or SiTU-GLU),
         in a CUDA graph. Float weights only: torch has no MXFP4 grouped GEMM, and the graph executor's own MXFP4 path is
         the Triton kernels (= `fused`), so an MXFP4 `graph` row says so instead of a time.
  fused  backends/fused/kernels/grouped_experts.py routed_experts (fused small-batch kernels at <= 16 tokens, grouped by
         expert above), in a CUDA graph; FP8 weights: backends/fused/kernels/fp8_experts.py (same dispatch); MXFP4 weights on the
         H200 with nvidia-cutlass-dsl: backends/fused/kernels/cute_experts.py (the fused executor's cute-latent-moe: weights
         re-laid out once before timing, activations as fp16 as for K3's bf16 model), the Triton kernels
         otherwise (the row's `experts_path` says which).
Method: all E experts of the shape (measure.SHAPES) on the GPU, random (MXFP4: random bytes, e8m0 118..123;
bf16: N(0, 1/in); FP8: weights.py's random FP8 codes and 128 x 128 block scales); ROTATIONS input sets, each token drawing A distinct experts uniformly, so consecutive
calls read different experts (not L2 hits). Time: one CUDA graph of one call per set, replayed by
triton.testing.do_bench (median, L2 flushed before each replay), / ROTATIONS; torch: eager calls over the
sets, the median of CUDA-event timings. floor = mean distinct experts per set x bytes per expert / HBM_READ_BPS;
MBU = floor / ms. Each row also records max |out - torch| / max |torch| over the first CHECKED sets (the
check that the timed path computes the same function).
"""

from __future__ import annotations

import gc
import statistics
from pathlib import Path

import torch

from .measure import (
    HBM_READ_BPS,
    SHAPES,
    default_out,
    environment,
    expert_weights,
    graph_replay_ms,
    write_result,
)

MOE_PRESETS = {"k3-moe": ("k3", ("mxfp4", "bf16")), "qwen3-moe": ("qwen3-30b-a3b", ("bf16",))}  # default formats
FORMATS = {"k3-moe": ("mxfp4", "bf16"), "qwen3-moe": ("bf16", "fp8")}  # --weights may pick from these
ROTATIONS = 8
CHECKED = 2  # sets whose output is compared with the torch path (the reference is slow at batch 256)


def expert_inputs(shape: dict, wfmt: str, T: int, gen: torch.Generator):
    D, A, E = shape["D"], shape["A"], shape["E"]
    xdt = torch.float32 if wfmt == "mxfp4" else torch.bfloat16  # LatentMoE feeds its experts fp32
    sets = []
    for _ in range(ROTATIONS):
        ids = torch.argsort(torch.rand(T, E, device="cuda", generator=gen), dim=1)[:, :A].contiguous()
        x = torch.randn(T, D, device="cuda", generator=gen).to(xdt)
        w = torch.rand(T, A, device="cuda", generator=gen) + 0.1
        sets.append((x, ids, w))
    return sets


def _path(executor: str, shape: dict, wfmt: str):
    """The function (x, ids, w, gu, dn) -> out each executor runs, or a string saying why there is none."""
    from .reference.latent_moe import latent_experts
    from .reference.moe import experts_grouped, experts_reference

    act = shape["act"]
    if executor == "torch":
        if wfmt == "mxfp4":
            return lambda x, ids, w, gu, dn: latent_experts(x, ids, w, gu, dn, act)
        if act != "silu":
            return lambda x, ids, w, gu, dn: latent_experts(x.float(), ids, w, gu, dn, act).to(x.dtype)
        return experts_reference
    if executor == "graph":
        if wfmt in ("mxfp4", "fp8"):
            return (f"no {wfmt.upper()} grouped GEMM in torch; the graph executor's {wfmt.upper()} experts are the "
                    f"Triton kernels (the fused row)")
        if act != "silu":  # K3 bf16: SiTU-GLU between the grouped GEMMs; fp32 activations -> bf16 for them
            return lambda x, ids, w, gu, dn: experts_grouped(x.to(gu.dtype), ids, w, gu, dn, act).float()
        return experts_grouped
    if executor == "fused" and wfmt == "fp8":
        from .backends.fused.kernels.fp8_experts import fp8_experts
        return lambda x, ids, w, gu, dn: fp8_experts(x, ids, w, gu, dn)
    if executor == "fused" and wfmt == "mxfp4" and cute_experts_ok(shape):
        from .backends.fused.kernels.cute_experts import cute_experts, frag_of
        return lambda x, ids, w, gu, dn: cute_experts(x, ids, w, frag_of(gu), frag_of(dn), act=act, split=False)
    if executor == "fused":
        from .backends.fused.kernels.grouped_experts import routed_experts
        return lambda x, ids, w, gu, dn: routed_experts(x, ids, w, gu, dn, act=act)
    return f"unknown executor {executor!r} for MoE presets (torch, graph, fused)"


def cute_experts_ok(shape: dict) -> bool:
    """Whether the fused executor's K3 experts would be the CuTe DSL kernels here (sm_90, the DSL installed,
    dims that are multiples of a record's k span)."""
    from .backends.fused.kernels.cute_experts import KREC

    try:
        import cutlass  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability() == (9, 0) and shape["D"] % KREC == 0 and shape["I"] % KREC == 0


def bench_row(executor: str, shape: dict, wfmt: str, T: int, gu, dn, expert_bytes: int, gen) -> dict:
    fn = _path(executor, shape, wfmt)
    row = {"executor": executor, "batch": T, "weights": wfmt}
    if executor == "fused" and wfmt == "mxfp4":
        row["experts_path"] = "cute" if cute_experts_ok(shape) else "triton"
    if isinstance(fn, str):
        return {**row, "error": fn}
    sets = expert_inputs(shape, wfmt, T, gen)
    distinct = [int(ids.unique().numel()) for _, ids, _ in sets]
    floor_ms = statistics.mean(distinct) * expert_bytes / HBM_READ_BPS * 1e3
    ref = _path("torch", shape, wfmt)
    err = 0.0
    for x, ids, w in sets[:CHECKED]:
        o, r = fn(x, ids, w, gu, dn).float(), ref(x, ids, w, gu, dn).float()
        if not torch.isfinite(o).all():
            raise ValueError(f"{executor}: non-finite output")
        err = max(err, float((o - r).abs().max()) / max(float(r.abs().max()), 1e-30))
    if executor == "torch":  # eager, host syncs: CUDA events around each call, one pass over the sets
        times = []
        for x, ids, w in sets:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn(x, ids, w, gu, dn)
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        ms = statistics.median(times)
    else:
        ms = graph_replay_ms(lambda: [fn(x, ids, w, gu, dn) for x, ids, w in sets], ROTATIONS)
    return {**row, "ms": ms, "floor_ms": floor_ms, "mbu": floor_ms / ms, "distinct_experts": statistics.mean(distinct),
            "bytes_per_expert": expert_bytes, "max_rel_err_vs_torch": err}


def run(args, argv: list[str]) -> int:
    from tqdm import tqdm

    shape_name, formats = MOE_PRESETS[args.preset]
    shape = SHAPES[shape_name]
    formats = args.weights or formats
    gpu = torch.cuda.get_device_name()
    rows = []
    for wfmt in formats:
        gen = torch.Generator(device="cuda").manual_seed(args.seed)
        gu, dn, expert_bytes = expert_weights(shape, wfmt, gen)
        for executor in args.executor:
            for T in tqdm(args.batch, desc=f"{args.preset} {wfmt} {executor}", unit="batch"):
                base = {"preset": args.preset, "executor": executor, "batch": T, "weights": wfmt}
                try:
                    rows.append({"preset": args.preset, **bench_row(executor, shape, wfmt, T, gu, dn, expert_bytes,
                                                                    gen)})
                except (torch.cuda.OutOfMemoryError, RuntimeError, ValueError) as e:
                    rows.append({**base, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"})
                gc.collect()
                torch.cuda.empty_cache()
        del gu, dn
        gc.collect()
        torch.cuda.empty_cache()
    out = Path(args.out) if args.out else default_out(args.preset, gpu)
    write_result(out, {**environment(argv), "shape": {**shape, "name": shape_name}, "rotations": ROTATIONS,
                       "hbm_read_bps": HBM_READ_BPS, "rows": rows})
    print(f"{gpu}, {args.preset} ({shape_name}: D={shape['D']} I={shape['I']} A={shape['A']} E={shape['E']}), "
          f"floor = distinct experts' bytes / {HBM_READ_BPS / 1e12:.2f} TB/s")
    print(format_table(rows))
    print(f"wrote {out}")
    return 0


def format_table(rows: list[dict]) -> str:
    lines = [f"{'weights':<7} {'executor':<8} {'batch':>5} {'ms':>9} {'floor ms':>9} {'MBU':>6} {'experts':>8} "
             f"{'err vs torch':>12}"]
    for r in rows:
        left = f"{r['weights']:<7} {r['executor']:<8} {r['batch']:>5} "
        if "error" in r:
            lines.append(left + f"error: {r['error'][:100]}")
        else:
            lines.append(left + f"{r['ms']:>9.4f} {r['floor_ms']:>9.4f} {r['mbu']:>6.1%} "
                         f"{r['distinct_experts']:>8.1f} {r['max_rel_err_vs_torch']:>12.2e}")
    return "\n".join(lines)
