"""`megadecode tune`: sweep a kernel's launch parameters on the GPU and store the best per batch in its
tuning file (megadecode/backends/fused/kernels/tuning.py; GPU only).

    megadecode tune --kernel fused-experts --shape k3 --batch 1,2,4,8,16
    megadecode tune --kernel grouped-experts --shape qwen3-30b-a3b --batch 1,8,64

Kernels: fused-experts (backends/fused/kernels/fused_experts.py, batch <= 16), grouped-experts
(backends/fused/kernels/grouped_experts.py: per pair at <= 16 tokens, grouped by expert above; its tuning keys
carry ",grouped=0|1") and fp8-experts (backends/fused/kernels/fp8_experts.py: FP8 block-scaled weights, blocks of
128 x 128, the same split by batch).
Method, per batch T: random expert weights of the shape (MXFP4: random packed bytes and e8m0 scales
118..123; bf16: N(0, 1/in)) for all E experts on the GPU; ROTATIONS id sets, each token drawing A distinct
experts uniformly, so consecutive timed calls read different experts and do not find them in L2. Every
candidate of GRID (the product, minus those the launcher would clamp to an already-seen config) runs on
every id set and must match the DEFAULT_BLOCKS output within TOLERANCE (max |got - ref| / max |ref|:
the pairs' fp32 sums run in a different order per block size, so results are close, not bitwise equal).
Time: one CUDA graph holding one call per id set, in turn (launch cost excluded, as under the graph
executor), replayed by triton.testing.do_bench (median ms, L2 cleared before each replay) / ROTATIONS.
floor = the mean number of distinct experts per id set x bytes per expert / HBM_READ_BPS; MBU = floor / ms.
The fastest candidate is merged into the file (other shapes and batches kept), with its ms, MBU, the command and the date.
"""

from __future__ import annotations

import datetime
import itertools
import shlex
import sys
from pathlib import Path

import torch

from .backends.fused.kernels import tuning
from .args import int_list, seed_arg
from .measure import (
    HBM_READ_BPS,
    SHAPES,
    expert_weights,
    graph_replay_ms,
)

KERNELS = ("fused-experts", "grouped-experts", "fp8-experts")
# The sweeps: every combination (fused-experts: 3 * 2 * 3 * 2 * 2 * 2 = 144 candidates; grouped-experts: 3 * 2
# * 2 = 12; fp8-experts: 3 * 3 * 2 * 2 = 36; each compiled once and reused per batch).
GRIDS = {
    "fused-experts": {
        "BLOCK_I": (16, 32, 64),     # stage 1 rows of gate/up per program
        "BLOCK_D": (128, 256),       # stage 1 reduction chunk over D
        "BLOCK_N": (16, 32, 64),     # stage 2 output columns per program
        "BLOCK_K": (128, 256),       # stage 2 reduction chunk over I
        "num_warps": (4, 8),
        "num_stages": (2, 3),
    },
    "grouped-experts": {
        "BLOCK_I": (16, 32, 64),  # stage 1 gate/up rows per program (the MMA's M side)
        "BLOCK_N": (32, 64),      # stage 2 output rows per program
        "num_stages": (3, 4),
    },
    "fp8-experts": {
        "BLOCK_I": (16, 32, 64),  # stage 1 gate/up rows per program: 16 gives batch 1 four times the programs
        "BLOCK_N": (16, 32, 64),  # stage 2 output rows per program
        "BLOCK_D": (64, 128),     # stage 1 reduction chunk (inside one 128-wide scale column)
        "num_stages": (2, 4),
    },
}
GRID = GRIDS["fused-experts"]
ROTATIONS = 8
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # max |got - ref| / max |ref|, by output dtype
# the activations: LatentMoE feeds fp32; the others bf16
X_DTYPE = {"mxfp4": torch.float32, "bf16": torch.bfloat16, "fp8": torch.bfloat16}


def candidates(grid: dict = GRID):
    keys = list(grid)
    for values in itertools.product(*(grid[k] for k in keys)):
        yield dict(zip(keys, values))


def add_parser(sub, help_: str) -> None:
    """The tune command's parser (`help_`: its line in `megadecode --help`, cli.HEAVY_COMMANDS)."""
    p = sub.add_parser("tune", help=help_,
                       description="Sweep launch parameters per batch on the GPU, check each against the "
                                   "default config's output, time it, and merge the fastest into the "
                                   "kernel's tuning file (megadecode/backends/fused/kernels/configs/<kernel>/<gpu>.json).")
    p.add_argument("--kernel", required=True, choices=KERNELS, help="the kernel whose launch parameters are swept")
    p.add_argument("--shape", required=True, choices=sorted(SHAPES),
                   help="the MoE layer shape to tune for")
    p.add_argument("--weights", choices=("mxfp4", "bf16", "fp8"), default=None,
                   help="expert weight format (default: the shape's own: mxfp4 for k3, bf16 otherwise; fp8 for, and "
                        "only for, --kernel fp8-experts)")
    p.add_argument("--batch", type=int_list, default=[1, 2, 4, 8, 16], help="comma-separated (default: 1,2,4,8,16)")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of the random weights and inputs, in [0, 2**32 - 1]")
    p.add_argument("--out", default=None, help="JSON path (default: the kernel's tuning file for this GPU)")
    p.set_defaults(func=run)


def tune_batch(fe, shape: dict, wfmt: str, T: int, gu, dn, expert_bytes: int, gen: torch.Generator,
               grid: dict = GRID) -> dict:
    """Sweep `grid` at batch T for kernel module `fe` (its `launch(x, ids, w, gu, dn, act, out, blocks)` and
    DEFAULT_BLOCKS); -> {"best": config, "ms", "mbu", "floor_ms", "default_ms", "tried", "failed"}."""
    D, A, E, act = shape["D"], shape["A"], shape["E"], shape["act"]
    xdt = X_DTYPE[wfmt]
    sets = []
    for _ in range(ROTATIONS):
        ids = torch.stack([torch.randperm(E, device="cuda", generator=gen)[:A] for _ in range(T)])
        x = torch.randn(T, D, device="cuda", generator=gen).to(xdt)
        w = torch.rand(T, A, device="cuda", generator=gen) + 0.1
        sets.append((x, ids, w))
    floor_ms = sum(int(ids.unique().numel()) for _, ids, _ in sets) / ROTATIONS * expert_bytes / HBM_READ_BPS * 1e3
    refs = [fe.launch(x, ids, w, gu, dn, act, None, fe.DEFAULT_BLOCKS) for x, ids, w in sets]
    outs = [torch.empty_like(r) for r in refs]
    tol = TOLERANCE[xdt]

    def timed(blocks) -> float:
        """ms per call: one CUDA graph of one call per id set (as the graph executor runs the kernel, so
        the Python launch cost is not timed), replayed by do_bench, divided by ROTATIONS."""
        return graph_replay_ms(lambda: [fe.launch(x, ids, w, gu, dn, act, o, blocks)
                                         for (x, ids, w), o in zip(sets, outs)], ROTATIONS)

    default_ms = timed(fe.DEFAULT_BLOCKS)
    best, best_ms, tried, failed = dict(fe.DEFAULT_BLOCKS), default_ms, 0, []
    for cand in candidates(grid):
        cand = {**fe.DEFAULT_BLOCKS, **cand}
        try:
            for (x, ids, w), ref, o in zip(sets, refs, outs):
                fe.launch(x, ids, w, gu, dn, act, o, cand)
                err = float((o.float() - ref.float()).abs().max()) / max(float(ref.float().abs().max()), 1e-30)
                if not err <= tol:
                    raise ValueError(f"output differs from DEFAULT_BLOCKS: {err:.2e} > {tol:.0e} relative")
            ms = timed(cand)
        except Exception as e:  # out of resources, compile errors, a wrong result: not a candidate
            failed.append((cand, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
            continue
        tried += 1
        if ms < best_ms:
            best, best_ms = cand, ms
    return {"best": best, "ms": best_ms, "mbu": floor_ms / best_ms, "floor_ms": floor_ms,
            "default_ms": default_ms, "tried": tried, "failed": failed}


def format_table(rows: list[dict], keys=tuple(GRID)) -> str:
    head = f"{'batch':>5} {'default ms':>10} {'best ms':>8} {'floor ms':>8} {'MBU':>6} {'ok/fail':>8}  " + \
        " ".join(f"{k}" for k in keys)
    lines = [head]
    for r in rows:
        lines.append(f"{r['batch']:>5} {r['default_ms']:>10.4f} {r['ms']:>8.4f} {r['floor_ms']:>8.4f} "
                     f"{r['mbu']:>6.1%} {r['tried']:>4}/{len(r['failed']):<3}  "
                     + " ".join(f"{r['best'][k]:>{len(k)}}" for k in keys))
    return "\n".join(lines)


def run(args, argv: list[str]) -> int:
    shape = SHAPES[args.shape]
    fp8 = args.kernel == "fp8-experts"
    wfmt = args.weights or ("fp8" if fp8 else shape["weights"])
    if (wfmt == "fp8") != fp8:
        raise ValueError(f"--weights {wfmt} with --kernel {args.kernel}: FP8 weights are fp8-experts' and only "
                         "its")
    if fp8 and shape["act"] != "silu":
        raise ValueError(f"fp8-experts computes SwiGLU (silu); shape {args.shape} uses {shape['act']}")
    if not torch.cuda.is_available():
        raise ValueError("tune needs a CUDA GPU, and torch.cuda.is_available() is False on this machine")
    from .backends.fused.kernels import fp8_experts, fused_experts, grouped_experts

    fe = {"fused-experts": fused_experts, "grouped-experts": grouped_experts,
          "fp8-experts": fp8_experts}[args.kernel]
    grid = GRIDS[args.kernel]
    limit = fused_experts.MAX_TOKENS if args.kernel == "fused-experts" else grouped_experts.MAX_BATCH
    if not args.batch or min(args.batch) < 1 or max(args.batch) > limit:
        raise ValueError(f"--batch values must be in 1..{limit} for {args.kernel}, got {args.batch}")
    gpu = torch.cuda.get_device_name()
    out = Path(args.out) if args.out else tuning.config_path(fe.KERNEL, gpu)
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    gu, dn, expert_bytes = expert_weights(shape, wfmt, gen)
    command = shlex.join(["megadecode", *argv])
    data = tuning.read(out) if out.is_file() else None
    rows = []
    for T in args.batch:
        key = fe.tuning_key(shape["D"], shape["I"], shape["A"], wfmt, shape["act"], T)
        r = tune_batch(fe, shape, wfmt, T, gu, dn, expert_bytes, gen, grid)
        rows.append({"batch": T, "key": key, **r})
        for cand, why in r["failed"][:3]:
            print(f"batch {T}: skipped {cand}: {why}", file=sys.stderr)
        data = tuning.merge(data, fe.KERNEL, gpu, key, T, r["best"], {
            "ms": r["ms"], "mbu": r["mbu"], "default_ms": r["default_ms"], "command": command,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
        tuning.write(out, data)  # after every batch: a long sweep that dies keeps what it measured
    tuning.clear_cache()
    print(f"{gpu}, {args.kernel} {args.shape} ({rows[-1]['key']}), E={shape['E']}, {ROTATIONS} rotating id sets; "
          f"do_bench median; floor = distinct experts' bytes / {HBM_READ_BPS / 1e12:.2f} TB/s")
    print(format_table(rows, tuple(grid)))
    print(f"wrote {out}")
    return 0
