"""The megakernel against its golden model and the reference, on the GPU (tiny presets, bf16).

For each preset and batch: one launch of the CuTe kernel and one pyvm run of the same program on the same inputs
and caches; every named buffer of the arenas and every cache is diffed (the first buffer that differs names the
instructions that wrote it). Then: a repeat of the launch must be bitwise identical; the `mega` executor's decode
logits against the `torch` executor's (bf16), and greedy generation of --tokens tokens against `torch`.
Writes a JSON summary to --out.

    python bench/mega_check.py --out $OUT/mega_check.json
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

from megadecode.cache import KVCache
from megadecode.engine import Engine
from megadecode.mega.lower import lower
from megadecode.mega.pyvm import PyVM
from megadecode.mega.runtime import MegaRuntime
from megadecode.mega.schedule import schedule
from megadecode.presets import preset_config
from megadecode.sampling import SamplingParams
from megadecode.weights import random_weights


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    if not torch.isfinite(a).all() or not torch.isfinite(b).all():
        return float("inf")
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


def diff_program(preset: str, batch: int, ctas: int, seed: int) -> dict:
    cfg = preset_config(preset)
    w = random_weights(cfg, "cuda", torch.bfloat16, seed)
    cache = KVCache(cfg, batch, 256, "cuda", torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(seed)
    for parts in cache.layers.values():
        for t in parts:
            t.normal_(generator=g)
    prog = schedule(lower(cfg, w, cache, batch, ctas), ctas)
    rt = MegaRuntime(prog, "cuda")
    tokens = torch.randint(0, cfg.vocab_size, (batch,), device="cuda", generator=g)
    positions = torch.randint(0, 200, (batch,), device="cuda", generator=g)
    slots = torch.randperm(batch, device="cuda", generator=g)
    before = {n: [t.clone() for t in parts] for n, parts in cache.layers.items()}
    for name, t in (("tokens", tokens), ("positions", positions), ("slots", slots)):
        rt.view(name).copy_(t)
    t0 = time.perf_counter()
    rt.launch()
    torch.cuda.synchronize()
    first_launch_s = time.perf_counter() - t0
    rt.check()
    mega_f32, mega_i32 = rt.f32.clone(), rt.i32.clone()
    mega_cache = {n: [t.clone() for t in parts] for n, parts in cache.layers.items()}
    # repeat on the same inputs and caches: bitwise identical
    for n, parts in cache.layers.items():
        for t, b in zip(parts, before[n]):
            t.copy_(b)
    rt.launch()
    torch.cuda.synchronize()
    rt.check()
    repeat_equal = torch.equal(rt.f32, mega_f32) and torch.equal(rt.i32, mega_i32)
    # pyvm on the same program
    for n, parts in cache.layers.items():
        for t, b in zip(parts, before[n]):
            t.copy_(b)
    vm = PyVM(prog)
    vm.i32.copy_(rt.i32[:vm.i32.numel()])
    vm.launch()
    rows = []
    for name, (off, n) in sorted(prog.f32.items(), key=lambda kv: kv[1][0]):
        rows.append({"buffer": name, "rel": rel(mega_f32[off:off + n], vm.f32[off:off + n])})
    for name, (off, n) in sorted(prog.i32.items(), key=lambda kv: kv[1][0]):
        rows.append({"buffer": name, "equal": bool(torch.equal(mega_i32[off:off + n], vm.i32[off:off + n]))})
    for n, parts in cache.layers.items():
        for i, (t, m) in enumerate(zip(parts, mega_cache[n])):
            rows.append({"buffer": f"{n}.{i}", "rel": rel(m, t)})
    bad = [r for r in rows if r.get("rel", 0) > 2e-2 or r.get("equal") is False]
    return {"preset": preset, "batch": batch, "ctas": ctas, "instructions": len(prog.instrs),
            "first_launch_s": first_launch_s, "repeat_bitwise_equal": repeat_equal,
            "buffers": rows, "mismatched": [r["buffer"] for r in bad]}


def end_to_end(preset: str, batch: int, tokens: int, seed: int) -> dict:
    cfg = preset_config(preset)
    w = random_weights(cfg, "cuda", torch.bfloat16, seed)
    prompts = [[(7 * i + j) % 250 + 3 for j in range(3 + i % 4)] for i in range(batch)]
    ref = Engine(cfg, w, executor="torch", max_batch=batch, max_seq_len=tokens + 16)
    mega = Engine(cfg, w, executor="mega", max_batch=batch, max_seq_len=tokens + 16)
    tok = ref.prefill(prompts).argmax(-1)
    mega.prefill(prompts)
    errs = []
    for _ in range(4):
        la, lb = ref.decode(tok), mega.decode(tok)
        errs.append(rel(lb, la))
        tok = la.argmax(-1)
    mega.executor.check_errors()
    greedy = SamplingParams(greedy=True)
    a = Engine(cfg, w, executor="torch", max_batch=batch, max_seq_len=tokens + 16).generate(prompts, tokens, greedy)
    b = Engine(cfg, w, executor="mega", max_batch=batch, max_seq_len=tokens + 16).generate(prompts, tokens, greedy)
    same = sum(x == y for ra, rb in zip(a.token_ids, b.token_ids) for x, y in zip(ra, rb))
    total = sum(len(r) for r in a.token_ids)
    first_div = [next((j for j, (x, y) in enumerate(zip(ra, rb)) if x != y), None)
                 for ra, rb in zip(a.token_ids, b.token_ids)]
    return {"preset": preset, "batch": batch, "decode_rel_err": errs, "greedy_tokens": total,
            "greedy_equal": same, "first_divergence": first_div}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="tiny-qwen3-moe,tiny-deepseek-v3")
    ap.add_argument("--batches", default="1,3,8")
    ap.add_argument("--ctas", type=int, default=0, help="0: every CTA the GPU holds")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", default="mega_check.json")
    args = ap.parse_args()
    from megadecode.executors.mega_executor import default_ctas

    ctas = args.ctas or default_ctas(torch.device("cuda"))
    res = {"gpu": torch.cuda.get_device_name(), "ctas": ctas, "diff": [], "e2e": []}
    for preset in args.presets.split(","):
        for b in map(int, args.batches.split(",")):
            try:
                r = diff_program(preset, b, ctas, seed=b)
            except Exception as e:  # noqa: BLE001  (report and go on: one GPU call, many cases)
                print(f"diff {preset} b={b}: {type(e).__name__}: {traceback.format_exc()[-1500:]}", flush=True)
                res["diff"].append({"preset": preset, "batch": b, "error": repr(e)})
                continue
            res["diff"].append(r)
            worst = max((x.get("rel", 0.0) for x in r["buffers"]), default=0.0)
            print(f"diff {preset} b={b}: {r['instructions']} instrs, worst rel {worst:.2e}, mismatched "
                  f"{r['mismatched'][:6]}, repeat equal {r['repeat_bitwise_equal']}, first launch "
                  f"{r['first_launch_s']:.1f}s", flush=True)
        for b in (1, 4):
            try:
                r = end_to_end(preset, b, args.tokens, seed=10 + b)
            except Exception as e:  # noqa: BLE001
                print(f"e2e {preset} b={b}: {type(e).__name__}: {traceback.format_exc()[-1500:]}", flush=True)
                res["e2e"].append({"preset": preset, "batch": b, "error": repr(e)})
                continue
            res["e2e"].append(r)
            print(f"e2e {preset} b={b}: decode rel {['%.1e' % e for e in r['decode_rel_err']]}, greedy "
                  f"{r['greedy_equal']}/{r['greedy_tokens']} equal, first divergence {r['first_divergence']}",
                  flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
