"""Expert parallelism on the GPUs of one host: the two combine modes alone, per batch (issue 17, item 1).

Run under torchrun, one process per GPU:

    torchrun --nproc-per-node 2 bench/ep_bench.py --batch 1,8,64 --width 3584 \\
        --out bench/results/ep-combine-nvidia-h200-x2.json --write-modes

For each batch T and mode (parallel/combine.py: all-gather, reduce-scatter) it captures LAYERS combines of fp32
partials [T, width] in one CUDA graph (NCCL inside the graph, as the decode step runs them) and times its replay
with CUDA events (median of --reps after --warmup replays, the ranks replaying in step), then reports ms per
combine and the faster mode. Both modes are checked to give the same bits as the rank-order sum before timing.
--write-modes merges the faster mode per batch into megadecode/parallel/configs/<gpu>.json, which the combine reads
(ExpertParallel.mode_for). Widths: 3584 = K3's latent (LatentMoE combines z before its norm); 2048 = Qwen3-30B-A3B's
hidden; 7168 = DeepSeek-V3 / Kimi K2's hidden.

The model-level numbers (step time, per-GPU MBU, communication per layer) come from `megadecode bench --ep N`
(docs/expert-parallelism.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys

import torch
import torch.distributed as dist

from megadecode.args import int_list
from megadecode.measure import git_sha
from megadecode.parallel import group
from megadecode.parallel.combine import ALL_GATHER, MODES, REDUCE_SCATTER, gather_combine, modes_path, scatter_combine
from megadecode.parallel.combine import sum_in_rank_order

FNS = {ALL_GATHER: gather_combine, REDUCE_SCATTER: scatter_combine}
LAYERS = 16  # combines per graph: per-combine time is the replay over LAYERS, launch costs amortized as in a step


def check(T: int, width: int, world: int, g) -> None:
    """Both modes against the rank-order sum of every rank's partial (regenerated from per-rank seeds)."""
    def partial(r):
        return torch.randn(T, width, device="cuda", generator=torch.Generator("cuda").manual_seed(7919 * r + T))

    x = partial(dist.get_rank())
    want = sum_in_rank_order(torch.stack([partial(r) for r in range(world)]))
    for mode, fn in FNS.items():
        if not torch.equal(fn(x, world, g), want):
            raise SystemExit(f"{mode} at batch {T} differs from the rank-order sum")


def time_mode(fn, T: int, width: int, world: int, g, warmup: int, reps: int) -> float:
    xs = [torch.randn(T, width, device="cuda") for _ in range(LAYERS)]
    for x in xs[:2]:
        fn(x, world, g)  # NCCL and the allocator warmed up before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x in xs:
            fn(x, world, g)
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    ms = []
    for _ in range(reps):
        dist.barrier(device_ids=[torch.cuda.current_device()])  # the ranks start each replay together
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        ms.append(a.elapsed_time(b) / LAYERS)
    return statistics.median(ms)


def merge_modes(path, gpu: str, world: int, width: int, best: dict[int, str], rows: list, command: str) -> None:
    data = json.loads(path.read_text()) if path.is_file() else {"device": gpu, "world": {}, "measured": {}}
    data.setdefault("world", {}).setdefault(str(world), {})[f"N={width}"] = {str(b): m for b, m in best.items()}
    data.setdefault("measured", {}).setdefault(str(world), {})[f"N={width}"] = {"rows": rows, "command": command,
                                                                               "git_sha": git_sha()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int_list, default=[1, 8, 64])
    ap.add_argument("--width", type=int, default=3584)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--out", default=None, help="JSON of the timings (rank 0 writes it)")
    ap.add_argument("--write-modes", action="store_true", help="merge the faster mode per batch into the modes file")
    args = ap.parse_args()
    ep = group.init(int(os.environ.get("WORLD_SIZE", "1")), "cuda", timeout_s=300)
    if ep is None:
        raise SystemExit("run under torchrun with 2 or more processes (one per GPU)")
    gpu = torch.cuda.get_device_name()
    rows, best = [], {}
    for T in args.batch:
        check(T, args.width, ep.world, ep.group)
        row = {"batch": T, "width": args.width, "world": ep.world, "bytes_per_rank": T * args.width * 4}
        for mode in MODES:
            row[f"{mode}_ms"] = time_mode(FNS[mode], T, args.width, ep.world, ep.group, args.warmup, args.reps)
        best[T] = min(MODES, key=lambda m: row[f"{m}_ms"])
        row["faster"] = best[T]
        rows.append(row)
    if ep.rank == 0:
        command = shlex.join(["torchrun", f"--nproc-per-node={ep.world}", *sys.argv])
        print(f"{gpu} x {ep.world}, fp32 partials of width {args.width}, {LAYERS} combines per CUDA graph, "
              f"median of {args.reps} replays")
        print(f"{'batch':>5} {'all-gather ms':>14} {'reduce-scatter ms':>17} faster")
        for r in rows:
            print(f"{r['batch']:>5} {r['all-gather_ms']:>14.4f} {r['reduce-scatter_ms']:>17.4f} {r['faster']}")
        if args.out:
            nccl = torch.cuda.nccl.version()
            doc = {"gpu": gpu, "world": ep.world, "torch": torch.__version__,
                   "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl), "git_sha": git_sha(),
                   "command": command, "rows": rows}
            with open(args.out, "w") as f:
                json.dump(doc, f, indent=2)
            print(f"wrote {args.out}")
        if args.write_modes:
            merge_modes(modes_path(gpu), gpu, ep.world, args.width, best, rows, command)
            print(f"merged the faster modes into {modes_path(gpu)}")
    ep.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
