"""Where does a decode step's GPU time go? Profiles the per-op step (the ops the `graph` or `fused`
executor captures), run eagerly under torch.profiler, and prints the top CUDA kernels and the number of
kernels per step, and the kernel time per plan op kind (each op's launches inside a profiler range named after
its kind: `op_kind_times`); also times the captured step. Usage:
    python bench/profile_step.py --preset qwen3-30b-a3b --batch 1 --context 1024
    python bench/profile_step.py --preset k3-mini --executor fused --batch 1,8
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from megadecode.engine import Engine
from megadecode.measure import HBM_READ_BPS
from megadecode.presets import preset_config
from megadecode.weights import random_weights


def op_weight_bytes(executor, op, ctx) -> int:
    """The weight bytes an op must read: its weights, a stack of routed experts ([E, ...], `.experts.` in its
    name) counted for the experts the step's router selected (topk_ids) only; the embedding's rows of the step's
    tokens only. Caches and activations left out."""
    total, picked = 0, None
    if op.kind == "embed":
        t = executor.weights[op.weights[0]]
        return int(ctx.buf["tokens"].unique().numel()) * t.shape[1] * t.element_size()
    for n in op.weights:
        t = executor.weights[n]
        nb = t.numel() * t.element_size()
        if ".experts." in n and ".shared_experts." not in n and t.dim() >= 3:
            if picked is None:
                picked = int(ctx.buf["topk_ids"].unique().numel())
            nb = nb * picked // t.shape[0]
        total += nb
    return total


def split_by_markers(kernels: list[tuple[str, float, float]], marker: str = "spin_kernel") -> list[list]:
    """kernels: (name, start us, duration us) of one stream's kernels in any order -> the kernels between
    consecutive marker kernels (names containing `marker`), in start order: group i holds those after the i-th
    marker (the first group those before the first marker, usually none). The markers themselves are left out."""
    groups: list[list] = [[]]
    for k in sorted(kernels, key=lambda k: k[1]):
        if marker in k[0]:  # CUPTI names it with its namespace: at::cuda::(anonymous namespace)::spin_kernel(long)
            groups.append([])
        else:
            groups[-1].append(k)
    return groups


def op_kernels(executor, step, device_type: str = "cuda"):
    """[(op, [(kernel name, start us, us), ...], weight bytes)] for one eager run_ops of `step`: a marker kernel
    (torch.cuda._sleep(0): `spin_kernel`) is launched before the first op and after each op, and the kernels
    one stream ran between two markers are the op's, whatever launched them (torch, Triton, CuTe DSL: ranges on
    the CPU side miss the kernels launched through the driver API). device_type "cpu" (tests): the ops' CPU
    time, one pseudo-kernel each."""
    ops = executor.plan.ops
    nbytes: list[int] = []
    cpu_t: list[float] = []
    state = {"t": 0.0}

    def mark():
        if device_type == "cuda":
            torch.cuda._sleep(0)
        else:
            import time
            state["t"] = time.perf_counter()

    def hook(op, ctx):
        if device_type != "cuda":
            import time
            cpu_t.append((time.perf_counter() - state["t"]) * 1e6)
        nbytes.append(op_weight_bytes(executor, op, ctx))  # before the marker: its own kernels (unique) are no op's
        mark()

    acts = [ProfilerActivity.CUDA] if device_type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        with torch.inference_mode():
            mark()
            executor.run_ops(step, hook)
        if device_type == "cuda":
            torch.cuda.synchronize()
    if len(nbytes) != len(ops):
        raise RuntimeError(f"run_ops called its hook {len(nbytes)} times for {len(ops)} ops")
    if device_type != "cuda":
        return [(op, [(op.kind, 0.0, t)], nb) for op, t, nb in zip(ops, cpu_t, nbytes)]
    evs = [(e.name, e.time_range.start, e.time_range.elapsed_us()) for e in prof.events()
           if e.device_type.name == "CUDA"]
    groups = split_by_markers(evs)
    if len(groups) != len(ops) + 2 or groups[0]:
        raise RuntimeError(f"{len(groups) - 1} markers for {len(ops)} ops ({len(groups[0])} kernels before the first)")
    return [(op, g, nb) for op, g, nb in zip(ops, groups[1:], nbytes)]


def op_kind_times(executor, step, device_type: str = "cuda") -> dict[str, tuple[int, float, int]]:
    """op kind -> (ops run, microseconds of kernel time in them, weight bytes they read: op_weight_bytes) for one
    eager run_ops of `step` (`op_kernels`). device_type "cpu": CPU time instead (tests)."""
    return kind_totals(op_kernels(executor, step, device_type))


def kind_totals(per_op) -> dict[str, tuple[int, float, int]]:
    """op_kernels' rows summed per op kind: (ops, microseconds of kernel time, weight bytes)."""
    out: dict[str, tuple[int, float, int]] = {}
    for op, ks, nb in per_op:
        n, t, b = out.get(op.kind, (0, 0.0, 0))
        out[op.kind] = (n + 1, t + sum(k[2] for k in ks), b + nb)
    return out


def graph_gaps(fn, device_type: str = "cuda") -> tuple[int, float, float]:
    """(kernels, their summed time in us, first start to last end in us) of one call of `fn` (a captured step's
    replay): the span less the kernel time is the GPU's idle time between the graph's kernels."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ks = [e for e in prof.events() if e.device_type.name == "CUDA" and e.time_range.elapsed_us() > 0]
    if not ks:
        return 0, 0.0, 0.0
    span = max(e.time_range.end for e in ks) - min(e.time_range.start for e in ks)
    return len(ks), sum(e.time_range.elapsed_us() for e in ks), float(span)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--batch", default="1")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--executor", default="graph", help="graph or fused (both capture run_ops)")
    ap.add_argument("--out", help="a JSON file: every op's kernels, the op kinds' totals, the graph's gaps")
    a = ap.parse_args()
    cfg = preset_config(a.preset)
    results = []
    w = random_weights(cfg, "cuda", torch.bfloat16, 0)
    for B in [int(b) for b in a.batch.split(",")]:
        eng = Engine(cfg, w, executor=a.executor, max_batch=B, max_seq_len=a.context + 64)
        for ts in eng.cache.layers.values():
            for t in ts:
                t.normal_()
        eng.lengths = [a.context] * B
        tok = torch.randint(0, 1000, (B,), device="cuda")
        for _ in range(3):
            eng.decode(tok)
            eng.lengths = [a.context] * B
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            eng.decode(tok)
            eng.lengths = [a.context] * B
        end.record()
        torch.cuda.synchronize()
        graph_ms = start.elapsed_time(end) / 10
        step = None
        from megadecode.step import Step
        slots = torch.arange(B, device="cuda")
        step = Step(tokens=tok, positions=torch.full((B,), a.context, device="cuda"), slots=slots,
                    logit_rows=slots, kv_len=a.context + 1, contiguous_slots=True)
        eng.executor.run_ops(step)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            with torch.inference_mode():
                eng.executor.run_ops(step)
            torch.cuda.synchronize()
        evs = [e for e in prof.events() if e.device_type.name == "CUDA"]
        total = sum(e.device_time for e in evs) / 1e3
        print(f"\n== {a.preset} {a.executor} batch {B}: captured step {graph_ms:.3f} ms; eager step has {len(evs)} kernels, "
              f"{total:.3f} ms of kernel time")
        rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:a.top]
        print(f"{'kernel':72s} {'calls':>6s} {'total us':>10s} {'us/call':>8s}")
        for e in rows:
            print(f"{e.key[:72]:72s} {e.count:6d} {e.device_time_total:10.1f} {e.device_time_total / e.count:8.2f}")
        per_op = op_kernels(eng.executor, step)
        kinds = kind_totals(per_op)
        print(f"\n{'op kind':16s} {'ops':>5s} {'kernel us':>10s} {'share':>6s} {'weight MB':>10s} {'floor us':>9s} "
              f"{'of floor':>8s}")
        whole = sum(t for _, t, _ in kinds.values()) or 1.0
        for kind, (n, t, nb) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
            floor = nb / HBM_READ_BPS * 1e6
            print(f"{kind:16s} {n:5d} {t:10.1f} {t / whole:6.1%} {nb / 1e6:10.1f} {floor:9.1f} "
                  f"{floor / t if t else 0:8.1%}")
        seen = set()
        for op, ks, nb in per_op:  # the first op of each kind, kernel by kernel
            if op.kind in seen:
                continue
            seen.add(op.kind)
            t = sum(k[2] for k in ks)
            print(f"-- {op.kind} (layer {op.layer}): {len(ks)} kernels, {t:.1f} us, {nb / 1e6:.1f} MB weights, "
                  f"floor {nb / HBM_READ_BPS * 1e6:.1f} us")
            for name, _, us in ks:
                print(f"     {us:8.1f}  {name[:100]}")
        n, kt, span = graph_gaps(lambda e=eng: (e.decode(tok), e.lengths.__setitem__(slice(None), [a.context] * B)))
        print(f"\ncaptured step under the profiler: {n} kernels, {kt:.1f} us of kernel time over a {span:.1f} us span "
              f"({span - kt:.1f} us idle between kernels, {(span - kt) / max(n - 1, 1):.2f} us a gap)")
        results.append({"preset": a.preset, "executor": a.executor, "batch": B, "graph_ms": graph_ms,
                         "graph_kernels": n, "graph_kernel_us": kt, "graph_span_us": span,
                         "kinds": {k: {"ops": v[0], "kernel_us": v[1], "weight_bytes": v[2]} for k, v in kinds.items()},
                         "ops": [{"kind": op.kind, "layer": op.layer, "weight_bytes": nb,
                                  "kernels": [[k[0], k[2]] for k in ks]} for op, ks, nb in per_op]})
        del eng
        torch.cuda.empty_cache()
    if a.out:
        import json

        json.dump({"gpu": torch.cuda.get_device_name(), "rows": results}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
