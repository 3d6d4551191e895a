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
    name) counted for the experts the step's router selected (topk_ids) only. Caches and activations left out."""
    total, picked = 0, None
    for n in op.weights:
        t = executor.weights[n]
        nb = t.numel() * t.element_size()
        if ".experts." in n and ".shared_experts." not in n and t.dim() >= 3:
            if picked is None:
                picked = int(ctx.buf["topk_ids"].unique().numel())
            nb = nb * picked // t.shape[0]
        total += nb
    return total


def op_kind_times(executor, step, device_type: str = "cuda") -> dict[str, tuple[int, float, int]]:
    """op kind -> (ops run, microseconds of kernel time in them, weight bytes they read: op_weight_bytes) for one
    eager run_ops of `step`: each op runs inside a profiler range named after its kind (opened before it, closed
    by run_ops' hook after it), and a range's device time is that of the kernels launched in it. device_type
    "cpu": CPU time instead (tests)."""
    ops = executor.plan.ops
    state = {"i": 0, "range": None}
    nbytes: dict[str, int] = {}

    def open_range(i):
        state["range"] = torch.autograd.profiler.record_function(f"op::{ops[i].kind}")
        state["range"].__enter__()

    def hook(op, ctx):
        state["range"].__exit__(None, None, None)
        nbytes[op.kind] = nbytes.get(op.kind, 0) + op_weight_bytes(executor, op, ctx)  # outside every range
        state["i"] += 1
        if state["i"] < len(ops):
            open_range(state["i"])

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == "cuda" else [])
    with profile(activities=acts) as prof:
        with torch.inference_mode():
            open_range(0)
            executor.run_ops(step, hook)
        if device_type == "cuda":
            torch.cuda.synchronize()
    if state["i"] != len(ops):
        raise RuntimeError(f"run_ops called its hook {state['i']} times for {len(ops)} ops")
    out: dict[str, tuple[int, float]] = {}
    for e in prof.events():  # the CPU-side ranges (a GPU-side copy of each annotation is left out)
        if e.name.startswith("op::") and e.device_type.name == "CPU":
            t = e.device_time_total if device_type == "cuda" else e.cpu_time_total
            n, total, _ = out.get(e.name[4:], (0, 0.0, 0))
            out[e.name[4:]] = (n + 1, total + t, nbytes[e.name[4:]])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--batch", default="1")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--executor", default="graph", help="graph or fused (both capture run_ops)")
    a = ap.parse_args()
    cfg = preset_config(a.preset)
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
        kinds = op_kind_times(eng.executor, step)
        print(f"\n{'op kind':16s} {'ops':>5s} {'kernel us':>10s} {'share':>6s} {'weight MB':>10s} {'floor us':>9s} "
              f"{'of floor':>8s}")
        whole = sum(t for _, t, _ in kinds.values()) or 1.0
        for kind, (n, t, nb) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
            floor = nb / HBM_READ_BPS * 1e6
            print(f"{kind:16s} {n:5d} {t:10.1f} {t / whole:6.1%} {nb / 1e6:10.1f} {floor:9.1f} "
                  f"{floor / t if t else 0:8.1%}")
        del eng
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
