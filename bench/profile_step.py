"""Where does a decode step's GPU time go? Profiles the per-op step (the ops the `graph` or `fused`
executor captures), run eagerly under torch.profiler, and prints the top CUDA kernels and the number of
kernels per step; also times the captured step. Usage:
    python bench/profile_step.py --preset qwen3-30b-a3b --batch 1 --context 1024
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from megadecode.engine import Engine
from megadecode.presets import preset_config
from megadecode.weights import random_weights


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
        del eng
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
