"""`megadecode bench`: time decode steps per (executor, batch) on the GPU and report them against the
memory-bandwidth floor.

Method. One set of random weights per preset is built on the GPU and shared by every engine. Prefill
is skipped (at batch 64 x 1024 tokens it costs more than the whole run on big models): each engine's
cache is filled with random values and every sequence is declared `context` tokens long, then
`warmup` steps run untimed and `steps` steps are timed one by one with CUDA events; each step feeds
the argmax of the previous logits. The reported time is the median step. Positions grow by one per
step, so attention reads context .. context + warmup + steps positions.

Bytes per step (what a step must read at least once): the trunk weights, every routed expert selected
by at least one sequence of the batch (counted per layer on one extra eager step), lm_head, and the KV
cache the batch attends to. Embedding rows are negligible and left out. floor = bytes / HBM_READ_BPS,
MBU = floor / measured.

Expert parallelism (`--ep N`, one GPU per rank): every rank times the same steps. Bytes per GPU: the trunk and the
cache (replicated: every rank runs the whole trunk for the whole batch), the rank's rows of an untied lm_head
(parallel/vocab.py) and its own selected experts; the row reports the largest over the ranks (the GPU the step
waits for), and MBU against it. Communication: the same steps again with the combines and the logits' all-gather
skipped (parallel/combine.py `comm = False`: same compute, wrong sums), and
`comm_ms_per_layer` = (ms - ms without communication) / MoE layers, `comm_share` = that time over the step.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from pathlib import Path

import torch

from . import ranks
from .config import ModelConfig
from .engine import Engine, resolve_dtype
from .args import int_list, seed_arg
from .measure import (
    HBM_READ_BPS,
    default_out,
    environment,
    write_result,
)
from .plan import ROUTER
from .presets import PRESETS, preset_config
from .step import Step
from .weights import random_weights, weight_bytes


def step_bytes(cfg: ModelConfig, distinct_experts_per_layer: list[int], batch: int, context: int,
               cache_bytes_per_token: int, dtype_bytes: int, state_bytes_per_sequence: int = 0) -> int:
    """Bytes one decode step must read: trunk + the union of selected experts per MoE layer + lm_head +
    the KV cache of `batch` sequences of `context` tokens + each sequence's fixed-size recurrent state
    (KDA layers: conv window and k x v state, read once per step)."""
    wb = weight_bytes(cfg, dtype_bytes)
    return (wb["trunk"] + sum(distinct_experts_per_layer) * wb["expert"] + wb["lm_head"]
            + batch * context * cache_bytes_per_token + batch * state_bytes_per_sequence)


def distinct_experts(engine: Engine, tokens: torch.Tensor) -> list[int]:
    """Run one eager decode step, built as `Engine.decode` builds it but without advancing
    `engine.lengths`, and count per MoE layer the experts selected by at least one sequence (under expert
    parallelism: those this rank holds)."""
    shard = None if engine.parallel is None else engine.parallel.shard
    B, dev = len(engine.lengths), engine.device
    slots = torch.arange(B, device=dev)
    step = Step(tokens=tokens, positions=torch.tensor(engine.lengths, device=dev), slots=slots,
                logit_rows=slots, kv_len=max(engine.lengths) + 1, contiguous_slots=True)
    counts: list[int] = []

    def hook(op, ctx):
        if op.kind == ROUTER:
            ids = ctx.buf["topk_ids"].unique()
            if shard is not None:
                ids = ids[(ids >= shard.lo) & (ids < shard.hi)]
            counts.append(int(ids.numel()))

    with torch.inference_mode():
        engine.executor.run_ops(step, hook=hook)
    return counts


def next_tokens(mode: str, logits: torch.Tensor, drawn: torch.Tensor | None, i: int) -> torch.Tensor:
    """The tokens fed to the decode step after step i: "greedy" the argmax of step i's logits; "random" row i of
    `drawn` (ids drawn before the timed loop, so no step times the draw)."""
    if mode == "greedy":
        return logits.argmax(-1)
    if mode == "random":
        return drawn[i]
    raise ValueError(f"tokens: greedy or random, got {mode!r}")


def time_decode(engine: Engine, batch: int, context: int, warmup: int, steps: int, seed: int,
                tokens_mode: str = "greedy"):
    """Median ms per decode step, the distinct experts per layer of one more step, and the wall time of the first
    step (its compiles and captures included: the cold start's second part), in seconds. tokens_mode
    (`next_tokens`): "greedy" feeds each step the last one's argmax (with random weights these collapse onto few
    distinct tokens, so large batches select fewer distinct experts than real traffic: k3-mini at batch 64 ~285 a
    layer where uniform routing gives ~610); "random" fresh random ids each step."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    first_s = None

    def decode(tokens):
        nonlocal first_s
        if first_s is not None:
            return engine.decode(tokens)
        t0 = time.perf_counter()
        out = engine.decode(tokens)
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        return out

    with torch.inference_mode():
        for ts in engine.cache.layers.values():
            for x in ts:
                x.normal_(generator=gen)
        engine.lengths = [context] * batch
        tokens = torch.randint(0, engine.cfg.vocab_size, (batch,), device="cuda", generator=gen)
        drawn = None if tokens_mode == "greedy" else \
            torch.randint(0, engine.cfg.vocab_size, (warmup + steps, batch), device="cuda", generator=gen)
        torch.cuda.synchronize()
        for i in range(warmup):
            tokens = next_tokens(tokens_mode, decode(tokens), drawn, i)
        events = []
        for i in range(warmup, warmup + steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            logits = decode(tokens)
            end.record()
            events.append((start, end))
            tokens = next_tokens(tokens_mode, logits, drawn, i)
        torch.cuda.synchronize()
    ms = statistics.median(s.elapsed_time(e) for s, e in events)
    return ms, distinct_experts(engine, tokens), first_s


_BUILT: set[str] = set()  # executors whose engine this process has built (compiles are cached per process)


def bench_one(cfg, weights, preset: str, executor: str, batch: int, args, parallel=None, ep=None) -> dict:
    mode = getattr(args, "tokens", "greedy")
    row = {"preset": preset, "executor": executor, "batch": batch, "context": args.context, "tokens": mode}

    def engine_of():
        return Engine(cfg, weights, executor=executor, max_batch=batch,
                      max_seq_len=args.context + args.warmup + args.steps + 8, parallel=parallel)

    first_in_process = executor not in _BUILT
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    engine = engine_of()
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    _BUILT.add(executor)
    ms, experts, first_s = time_decode(engine, batch, args.context, args.warmup, args.steps, args.seed, mode)
    # the cold start: the engine's construction and its first decode step, wall clock (kernel compiles included
    # where this process had not built this executor before: `first_in_process`; on-disk caches such as Triton's
    # are not cleared, so a compile cached there from an earlier process is not in it)
    row.update(cold_start_s=build_s + first_s, engine_build_s=build_s, first_step_s=first_s,
               first_in_process=first_in_process,
               # the most GPU memory allocated from the engine's build to its last timed step (the weights, the
               # cache, graphs, and a re-layout of the experts where the executor makes one: expert_layout.py)
               peak_alloc_gb=torch.cuda.max_memory_allocated() / 1e9)
    nbytes = step_bytes(cfg, experts, batch, args.context, engine.cache.bytes_per_token(),
                        torch.empty((), dtype=engine.dtype).element_size(),
                        engine.cache.state_bytes_per_sequence())
    if parallel is not None:  # per GPU: the rank with the most bytes
        import torch.distributed as dist

        every: list = [None] * parallel.world
        dist.all_gather_object(every, nbytes, group=ep.control)
        nbytes = max(every)
        del engine
        gc.collect()
        torch.cuda.empty_cache()
        parallel.comm = False
        try:
            quiet, _, _ = time_decode(engine_of(), batch, args.context, args.warmup, args.steps, args.seed, mode)
        finally:
            parallel.comm = True
        moe_layers = sum(cfg.moe_layers)
        row.update(ep=parallel.world, ms_no_comm=quiet, bytes_per_rank=every,
                   comm_ms_per_layer=(ms - quiet) / max(moe_layers, 1), comm_share=(ms - quiet) / ms)
    floor_ms = nbytes / HBM_READ_BPS * 1e3
    row.update(ms_per_step=ms, tokens_per_s=batch / (ms / 1e3), bytes_per_step=nbytes, floor_ms=floor_ms,
               mbu=floor_ms / ms)
    return row


def format_table(rows: list[dict]) -> str:
    ep = any("ep" in r for r in rows)
    head = f"{'preset':<16} {'executor':<8} {'batch':>5} {'context':>7} {'ms/step':>9} {'tok/s':>10} " \
           f"{'GB/step':>8} {'floor ms':>8} {'MBU':>6}"
    if ep:  # per GPU; communication per MoE layer and its share of the step
        head = head.replace("GB/step ", "GB/GPU  ") + f" {'comm ms/layer':>13} {'comm %':>6}"
    lines = [head]
    for r in rows:
        left = f"{r['preset']:<16} {r['executor']:<8} {r['batch']:>5} {r['context']:>7} "
        if "error" in r:
            err = r["error"] if len(r["error"]) <= 100 else r["error"][:97] + "..."
            lines.append(left + f"error: {err}")
        else:
            line = left + f"{r['ms_per_step']:>9.3f} {r['tokens_per_s']:>10.1f} " \
                          f"{r['bytes_per_step'] / 1e9:>8.3f} {r['floor_ms']:>8.3f} {r['mbu']:>6.1%}"
            if "comm_ms_per_layer" in r:
                line += f" {r['comm_ms_per_layer']:>13.4f} {r['comm_share']:>6.1%}"
            lines.append(line)
    return "\n".join(lines)


def add_parser(sub, help_: str) -> None:
    """The bench command's parser (`help_`: its line in `megadecode --help`, cli.HEAVY_COMMANDS)."""
    p = sub.add_parser("bench", help=help_,
                       description="Time decode steps on the GPU with random weights and a filled cache; "
                                   "report ms/step, tokens/s and MBU against the HBM read floor.")
    p.add_argument("--preset", required=True,
                   help=f"a model preset ({', '.join(sorted(PRESETS))}) or a MoE-layer preset (k3-moe, qwen3-moe: "
                        "the routed experts alone, executors torch, graph, fused)")
    p.add_argument("--batch", type=int_list, default=[1, 8, 64], help="comma-separated (default: 1,8,64)")
    p.add_argument("--executor", type=lambda s: [x for x in s.split(",") if x], default=["torch", "graph"],
                   help="comma-separated (default: torch,graph)")
    p.add_argument("--context", type=int, default=1024, help="tokens already in the cache per sequence")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed decode steps before the timed ones")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="weight and cache dtype")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of the random weights, in [0, 2**32 - 1]")
    p.add_argument("--tokens", choices=("greedy", "random"), default="greedy",
                   help="the tokens each step is fed: the last step's argmax (greedy; with random weights they "
                        "collapse onto few distinct tokens, so large batches select fewer experts than real "
                        "traffic) or fresh random ids (random)")
    p.add_argument("--weights", type=lambda s: [x for x in s.split(",") if x], default=None,
                   help="MoE-layer presets only: expert weight formats, comma-separated (k3-moe: mxfp4, bf16, "
                        "default both; qwen3-moe: bf16, fp8, default bf16)")
    p.add_argument("--out", default=None, help="JSON path (default: bench/results/<preset>-<gpu>.json; with --ep N, "
                                               "<preset>-ep<N>-<gpu>.json)")
    ranks.add_args(p)
    p.set_defaults(func=run)


def run(args, argv: list[str]) -> int:
    from . import bench_moe
    from .backends import EXECUTORS

    if args.preset in bench_moe.MOE_PRESETS and args.ep != 1:
        raise ValueError(f"--ep applies to the model presets; {args.preset} times one layer's experts on one GPU")
    if args.preset in bench_moe.MOE_PRESETS:
        formats = bench_moe.FORMATS[args.preset]
        bad = [w for w in args.weights or () if w not in formats]
        bad += [e for e in args.executor if e not in ("torch", "graph", "fused")]
        if bad:
            raise ValueError(f"{args.preset}: unknown weight format or executor {bad[0]!r} (weights: "
                             f"{', '.join(formats)}; executors: torch, graph, fused)")
    elif args.weights:
        raise ValueError("--weights applies to the MoE-layer presets (k3-moe, qwen3-moe) only")
    if not args.batch or min(args.batch) < 1 or args.steps < 1 or args.warmup < 0 or args.context < 1:
        raise ValueError("--batch values, --steps and --context must be >= 1 and --warmup >= 0")
    if not torch.cuda.is_available():
        raise ValueError("bench needs a CUDA GPU, and torch.cuda.is_available() is False on this machine")
    if args.preset in bench_moe.MOE_PRESETS:
        return bench_moe.run(args, argv)
    cfg = preset_config(args.preset)
    bad = [e for e in args.executor if e not in EXECUTORS]
    if bad:
        raise ValueError(f"unknown executor {bad[0]!r}; choose from {', '.join(sorted(EXECUTORS))}")
    need = args.context + args.warmup + args.steps + 8
    if need > cfg.max_position_embeddings:
        raise ValueError(f"--context {args.context} + warm-up + steps needs {need} positions; "
                         f"{args.preset} allows {cfg.max_position_embeddings}")
    ranks.check(cfg, args.ep)
    if ranks.must_spawn(args.ep):
        return ranks.spawn(argv, args.ep)
    args.device = "cuda"
    ep = ranks.join(args)
    try:
        return _bench(cfg, args, argv, ep)
    finally:
        if ep is not None:
            ep.destroy()


def _bench(cfg, args, argv, ep) -> int:
    from tqdm import tqdm

    from .parallel.group import agree

    gpu = torch.cuda.get_device_name()
    parallel = ranks.expert_parallel(ep, cfg)
    weights = agree(ep, random_weights, cfg, ranks.device(args, ep), resolve_dtype(args.dtype), args.seed,
                    None if parallel is None else parallel.shard)
    rows = []
    configs = [(e, b) for e in args.executor for b in args.batch]
    for executor, batch in tqdm(configs, desc=f"bench {args.preset}", unit="config", file=sys.stderr,
                                disable=not ranks.leader()):
        try:
            rows.append(bench_one(cfg, weights, args.preset, executor, batch, args, parallel, ep))
        except (torch.cuda.OutOfMemoryError, RuntimeError, ValueError) as e:
            if ep is not None:  # the ranks may be out of step: stop (the others fail at their next collective)
                raise
            rows.append({"preset": args.preset, "executor": executor, "batch": batch, "context": args.context,
                         "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"})
        gc.collect()
        torch.cuda.empty_cache()
    if not ranks.leader():
        return 0
    name = args.preset if ep is None else f"{args.preset}-ep{ep.world}"
    out = Path(args.out) if args.out else default_out(name, gpu)
    write_result(out, {**environment(argv), "rows": rows})
    where = "" if ep is None else f", {ep.world} GPUs (expert parallel; bytes and MBU per GPU)"
    print(f"{gpu}{where}, {args.dtype}, context {args.context}, median of {args.steps} steps after {args.warmup} "
          f"warm-up; floor = bytes / {HBM_READ_BPS / 1e12:.2f} TB/s")
    print(format_table(rows))
    print(f"wrote {out}")
    return 0
