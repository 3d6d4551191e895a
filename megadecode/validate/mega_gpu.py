"""The megakernel against its golden model and the reference, on a GPU: what bench/mega_check.py reports and the GPU
tests (tests/test_mega_gpu.py) assert. It sits with the harness (it runs the engine).

`diff_program`: one launch of the CuTe kernel and one pyvm run of the same program on the same inputs and caches;
every named buffer of the arenas and every cache is diffed (the first buffer that differs names the instructions
that wrote it); a repeat of the launch, and launches of the debug build with random delays, must be bitwise
identical. `end_to_end`: the `mega` executor's decode logits against pyvm's (tight) and the bf16 `torch` executor's
(statistical: routing near ties), and greedy generation against `torch` in bf16 and in fp32 (counts).
"""

from __future__ import annotations

import time

import torch

from ..cache import KVCache
from ..engine import Engine
from ..backends import expert_layout
from ..backends.mega.executor import frag_order
from ..backends.mega.lower import lower
from ..backends.mega.pyvm import PyVM
from ..backends.mega.runtime import MegaRuntime
from ..backends.mega.schedule import schedule
from ..config import config_from_hf
from ..plan import build_plan
from ..presets import preset_config, preset_hf_config
from ..sampling import SamplingParams
from ..weights import random_weights
from .near_tie import RoutingMargins, logit_agreement

MISMATCH = 2e-2  # a buffer whose relative difference exceeds this is named in `mismatched`
# what passes, for bench/mega_check.py's exit status and tests/test_mega_gpu.py alike (`diff_failures`,
# `e2e_failures`): bf16 weights and caches, fp32 activations in both. Every buffer of a launch against pyvm: measured
# worst 2.1e-3 (tiny-k3, batch 16: a bf16 cache row whose fp32 input crossed a rounding boundary; H200)
BUFFER_TOL = 5e-3
# decode logits against pyvm over a few steps (the same math): measured worst 1.5e-4 (tiny-k3, batch 4; H200).
# Asserted on its own (`e2e_failures`), not only through the buffers: an error can pass every buffer and still show
# here (a single bf16 rounding of the tensor-core rows' input gives 1.1e-2 on the logits while every buffer passes)
E2E_PYVM_TOL = 1e-3


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| over the finite entries; inf unless both have the same non-finite entries (the
    attention partials of an empty split hold -inf)."""
    a, b = a.float().cpu(), b.float().cpu()
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    if not torch.equal(fa, fb) or not torch.equal(a[~fa], b[~fb]):
        return float("inf")
    if not fa.any():
        return 0.0
    return ((a[fa] - b[fb]).abs().max() / b[fb].abs().max().clamp_min(1e-6)).item()


# Cases beyond the presets: tiny-k3 with MXFP4 expert rows longer than one 1024-weight chunk, neither a multiple of
# it (the experts' loops walk a row by chunks of 1024 weights: a last chunk of 32 weights, lane 0 alone; 33 and 65
# scale bytes a row, so a row's scales start anywhere in their 16-byte blocks). tiny-k3's rows are 32.
# tiny-qwen3-gqa: tiny-qwen3-moe with qwen3-30b-a3b's attention shape (head_dim 128, 16 q heads a KV head here,
# 8 there), what GQA attention's thread layout (cute/attention.py gqa_chunk) is built for; tiny-qwen3-moe's
# head_dim 16 and 2 q heads a KV head take its clamped pieces and partial head groups.
# tiny-k3-frag: latent and intermediate widths of whole 256-wide records (and an intermediate of 3 records, not a
# power of two), so its experts are held in fragment order and run on the tensor cores (F_FRAG, cute/moe.py) as
# K3's do; 24 experts (not a power of two), top 4.
CASES = {"tiny-k3-wide": ("tiny-k3", {"latent_size": 1056, "moe_intermediate_size": 2080}),
         "tiny-k3-frag": ("tiny-k3", {"latent_size": 512, "moe_intermediate_size": 768, "num_experts": 24,
                                      "n_group": 4, "topk_group": 2}),
         "tiny-qwen3-gqa": ("tiny-qwen3-moe", {"num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128}),
         # more experts than F_GROUP's tables hold (isa.GROUP_MAX_E): bf16 experts past PAIR1_MAX_B tokens in
         # PASS-pair passes on the CUDA cores, EXPERT_DOWN's row tiles with the combine fused
         "tiny-qwen3-e520": ("tiny-qwen3-moe", {"num_experts": 520}),
         # true dims, 2 layers: the batch-1 tiles as the real model stages them (several a CTA a phase, so each
         # ring slot is reused, k slices on the staged rows), the lm_head of 151936 rows unstaged
         "qwen3-30b-a3b-2l": ("qwen3-30b-a3b", {"num_hidden_layers": 2})}


def case_config(name: str):
    """A preset's config, or a CASES entry's: its preset's with the overrides."""
    if name not in CASES:
        return preset_config(name)
    base, over = CASES[name]
    return config_from_hf({**preset_hf_config(base), **over})


# Contexts a diff runs at (`diff_program(context=...)`): "random" positions below 200 of a 256-position cache (splits
# of one 64-position chunk or less, as every case before); "one" every sequence at position 0 (one cached position);
# "max" every sequence at the cache's last position, with a cache of 1000 positions, so that every attention split
# spans several chunks and ends on a partial one (1000 positions over S splits)
CONTEXTS = {"random": 256, "one": 256, "max": 1000}
# The cases that reach every path of the kernel's loops, for bench/mega_check.py --cases paths and the GPU tests:
# batch tails off the powers of two up to the megakernel's largest batch (64; 65 is refused by lower.supports);
# experts holding several passes of pairs (bf16 from isa.GROUP_MIN_B tokens is grouped, GROUP_N pairs a pass: at 33
# and 64 tokens, top-2 of tiny-qwen3-moe's 8 experts average 8 and 16 pairs an expert; tiny-qwen3-e520's 520
# experts take the CUDA-core loop's PASS pairs a pass instead; MXFP4, tiny-k3, takes one pair a pass, so any expert
# with two pairs has several); contexts 1 and the last position of a 1000-position cache (attention splits of
# several 64-position chunks, the last partial)
PATH_CASES = ([(p, b, "max") for p in ("tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-k3") for b in (1, 2, 5, 17)]
              + [(p, b, "random") for p in ("tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-k3") for b in (9, 33, 64)]
              + [("tiny-qwen3-e520", 33, "random")]
              + [(p, 3, "one") for p in ("tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-k3")])


def _positions(context: str, batch: int, max_len: int, g) -> torch.Tensor:
    if context == "random":
        return torch.randint(0, 200, (batch,), device="cuda", generator=g)
    if context == "one":
        return torch.zeros(batch, dtype=torch.int64, device="cuda")
    if context == "max":
        return torch.full((batch,), max_len - 1, dtype=torch.int64, device="cuda")
    raise ValueError(f"context {context!r}: one of {sorted(CONTEXTS)}")


def diff_program(preset: str, batch: int, ctas: int, seed: int, delay_runs: int = 3, context: str = "random",
                 kernel=None, ring: bool | None = None) -> dict:
    """`context`: CONTEXTS; `kernel`: another build of the launcher (a planted one, validate/mega_plants.py, or a
    bench variant's); `ring`: which build `kernel` is (MegaRuntime's default: the ring build for another kernel)."""
    if context not in CONTEXTS:
        raise ValueError(f"context {context!r}: one of {sorted(CONTEXTS)}")
    max_len = CONTEXTS[context]
    cfg = case_config(preset)
    w = random_weights(cfg, "cuda", torch.bfloat16, seed)
    # the routed experts in the order the mega executor holds them (fragment order where K3's widths allow)
    w = expert_layout.take(w, build_plan(cfg), frag_order(cfg, "cuda"))
    cache = KVCache(cfg, batch, max_len, "cuda", torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(seed)
    for parts in cache.layers.values():
        for t in parts:
            t.normal_(generator=g)
    prog = schedule(lower(cfg, w, cache, batch, ctas), ctas)
    rt = MegaRuntime(prog, "cuda", kernel=kernel, ring=ring)
    print(f"  {preset} b={batch} {context}: {len(prog.instrs)} instructions on {ctas} CTAs, launching", flush=True)
    tokens = torch.randint(0, cfg.vocab_size, (batch,), device="cuda", generator=g)
    positions = _positions(context, batch, max_len, g)
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
    # the debug build: random delays before every instruction's stores and after its signal; still bitwise equal
    delayed = MegaRuntime(prog, "cuda", delay_ns=20000, kernel=kernel, ring=ring)
    delays_equal = True
    for _ in range(delay_runs):
        for n, parts in cache.layers.items():
            for t, b in zip(parts, before[n]):
                t.copy_(b)
        for name, t in (("tokens", tokens), ("positions", positions), ("slots", slots)):
            delayed.view(name).copy_(t)
        delayed.launch()
        torch.cuda.synchronize()
        delayed.check()
        delays_equal &= torch.equal(delayed.f32, mega_f32) and torch.equal(delayed.i32, mega_i32)
    # pyvm on the same program, on the CPU (copies of the weights and of the caches before the launch)
    for n, parts in cache.layers.items():
        for t, b in zip(parts, before[n]):
            t.copy_(b)
    cpu = prog.to("cpu")
    vm = PyVM(cpu)
    vm.i32.copy_(rt.i32[:vm.i32.numel()].cpu())
    vm.launch()
    vm_cache = {t.name: t.tensor for t in cpu.tensors if t.role == "produced"}
    rows = []
    for name, (off, n) in sorted(prog.f32.items(), key=lambda kv: kv[1][0]):
        rows.append({"buffer": name, "rel": rel(mega_f32[off:off + n], vm.f32[off:off + n])})
    for name, (off, n) in sorted(prog.i32.items(), key=lambda kv: kv[1][0]):
        rows.append({"buffer": name, "equal": bool(torch.equal(mega_i32[off:off + n].cpu(), vm.i32[off:off + n]))})
    for n, parts in mega_cache.items():
        for i, m in enumerate(parts):
            if f"{n}.{i}" in vm_cache:
                rows.append({"buffer": f"{n}.{i}", "rel": rel(m, vm_cache[f"{n}.{i}"])})
    bad = [r for r in rows if r.get("rel", 0) > MISMATCH or r.get("equal") is False]
    return {"preset": preset, "batch": batch, "ctas": ctas, "context": context, "max_len": max_len,
            "longest_split": longest_split(prog, positions.tolist()), "instructions": len(prog.instrs),
            "first_launch_s": first_launch_s, "repeat_bitwise_equal": repeat_equal,
            "delayed_runs": delay_runs, "delayed_bitwise_equal": bool(delays_equal),
            "buffers": rows, "mismatched": [r["buffer"] for r in bad]}


def longest_split(prog, positions: list[int]) -> int:
    """The most cache positions one attention instruction (ATTN_GQA, MLA_ATTN) of the program covers at these
    positions: over 64 (the kernel's chunk) means the case runs splits of several chunks."""
    out = 0
    for ins in prog.instrs:
        if ins.op in ("ATTN_GQA", "MLA_ATTN"):
            a = ins.args
            n = positions[a["b"]] + 1
            out = max(out, (a["s"] + 1) * n // a["S"] - a["s"] * n // a["S"])
    return out


def timeout_case(preset: str = "tiny-qwen3-moe", batch: int = 2, ctas: int = 16, kernel=None,
                 max_spin: int = 1 << 12) -> dict:
    """Force a wait past its limit: one launch of a program whose first signalling instruction after the embedding
    has its signal removed on the device (its consumers wait for a count that never comes), with a short spin
    limit. The kernel must return (not hang), and MegaRuntime.check must raise MegaError naming the waiting
    instruction and the counter. `kernel`: another build (a planted one)."""
    from ..backends.mega.runtime import MegaError

    cfg = case_config(preset)
    w = random_weights(cfg, "cuda", torch.bfloat16, 0)
    cache = KVCache(cfg, batch, 64, "cuda", torch.bfloat16)
    prog = schedule(lower(cfg, w, cache, batch, ctas), ctas)
    rt = MegaRuntime(prog, "cuda", max_spin=max_spin, kernel=kernel)
    victim = next(i for i, ins in enumerate(prog.instrs) if ins.signal >= 1)
    counter = prog.instrs[victim].signal
    rt.rows[victim, 2] = -1
    rt.view("tokens").copy_(torch.arange(batch, device="cuda"))
    rt.view("positions").zero_()
    rt.view("slots").copy_(torch.arange(batch, device="cuda"))
    t0 = time.perf_counter()
    rt.launch()
    torch.cuda.synchronize()
    out = {"preset": preset, "batch": batch, "max_spin": max_spin, "silenced": prog.instrs[victim].name,
           "counter": counter, "launch_s": time.perf_counter() - t0, "raised": False, "message": ""}
    try:
        rt.check()
    except MegaError as e:
        _, instr, ctr, seen, target = rt.err.tolist()[:5]
        waiter = prog.instrs[instr]
        # every phase from the silenced counter on is blocked: whichever of their waits gives up first reports
        out.update(raised=True, message=str(e), waiter=waiter.name, reported_counter=ctr,
                   names_waiter=f"instruction {instr} ({waiter.name})" in str(e),
                   names_counter=f"counter {ctr} " in str(e),
                   consistent=ctr >= counter and seen - target < 0 and any(wt.counter == ctr for wt in waiter.waits))
    return out


def nan_route_case(preset: str, batch: int, ctas: int = 16) -> dict:
    """Every router's weights NaN, so every MoE layer routes NaN scores: the picks must still be experts (an id of
    E would send the expert phases past the expert tensors), and where the picks are defined by pyvm's stable sort
    (softmax routing without expert groups: every score NaN picks experts 0 .. A - 1) the same ids as pyvm."""
    cfg = case_config(preset)
    w = random_weights(cfg, "cuda", torch.bfloat16, 0)
    for k in w:
        if k.endswith("mlp.gate.weight"):
            w[k].fill_(float("nan"))
    w = expert_layout.take(w, build_plan(cfg), frag_order(cfg, "cuda"))
    cache = KVCache(cfg, batch, 64, "cuda", torch.bfloat16)
    prog = schedule(lower(cfg, w, cache, batch, ctas), ctas)
    rt = MegaRuntime(prog, "cuda")
    for name in ("tokens", "positions", "slots"):
        rt.view(name).copy_(torch.arange(batch, device="cuda") if name != "positions" else
                            torch.zeros(batch, dtype=torch.int32, device="cuda"))
    rt.launch()
    torch.cuda.synchronize()
    rt.check()
    E, A = cfg.num_experts, cfg.top_k
    off, n = prog.i32["ids"]
    ids = rt.i32[off:off + n].cpu().view(batch, A)
    vm = PyVM(prog.to("cpu"))
    vm.i32.copy_(rt.i32[:vm.i32.numel()].cpu())
    vm.launch()
    return {"preset": preset, "batch": batch, "E": E, "A": A, "ids": ids.tolist(),
            "in_bounds": bool(((ids >= 0) & (ids < E)).all()),
            "pyvm_ids": vm.i32[off:off + n].view(batch, A).tolist(),
            "sorted_defined": cfg.score_func == "softmax" and (cfg.n_group or 1) <= 1}


def nan_route_failures(r: dict) -> list[str]:
    """Why a `nan_route_case` row fails (empty: it passes)."""
    why = []
    if not r["in_bounds"]:
        why.append(f"{r['preset']} b={r['batch']}: NaN routing picked ids outside 0 .. {r['E'] - 1}: {r['ids']}")
    if r["sorted_defined"] and r["ids"] != r["pyvm_ids"]:
        why.append(f"{r['preset']} b={r['batch']}: NaN routing ids {r['ids']} differ from pyvm's {r['pyvm_ids']}")
    return why


def timeout_failures(r: dict) -> list[str]:
    """Why a `timeout_case` row fails (empty: it passes)."""
    if not r["raised"]:
        return ["a wait past its limit raised no MegaError (the launch went on as if satisfied)"]
    why = []
    if not r.get("names_waiter"):
        why.append(f"the error does not name the waiting instruction: {r['message']}")
    if not r.get("names_counter"):
        why.append(f"the error does not name the counter: {r['message']}")
    if not r.get("consistent"):
        why.append(f"the instruction named ({r.get('waiter')}) does not wait on counter {r.get('reported_counter')}, "
                   f"or that counter is not blocked by the silenced {r['counter']}")
    return why


def end_to_end(preset: str, batch: int, tokens: int, seed: int, steps: int = 4) -> dict:
    """`steps` teacher-forced decode steps (every engine is fed the bf16 torch executor's greedy tokens) through
    `mega`, the bf16 `torch` executor and `pyvm` (the kernel's golden model, run by torch on the GPU); their logits
    compared (near_tie.logit_agreement); then greedy generation of `tokens` against torch in bf16 and fp32 (counts
    only: routing margins of ~1e-4 make token-for-token agreement a matter of luck in bf16)."""
    cfg = case_config(preset)
    w = random_weights(cfg, "cuda", torch.bfloat16, seed)
    prompts = [[(7 * i + j) % 250 + 3 for j in range(3 + i % 4)] for i in range(batch)]
    ref = Engine(cfg, w, executor="torch", max_batch=batch, max_seq_len=tokens + 16)
    mega = Engine(cfg, w, executor="mega", max_batch=batch, max_seq_len=tokens + 16)
    vm = Engine(cfg, w, executor="pyvm", max_batch=batch, max_seq_len=tokens + 16)
    margins = RoutingMargins(ref)
    tok = ref.prefill(prompts).argmax(-1)
    mega.prefill(prompts)
    vm.prefill(prompts)
    la, lb, lc = [], [], []
    for _ in range(steps):
        la.append(ref.decode(tok).float())
        lb.append(mega.decode(tok).float().clone())
        lc.append(vm.decode(tok).float())
        tok = la[-1].argmax(-1)
    mega.executor.check_errors()
    la, lb, lc = torch.stack(la), torch.stack(lb), torch.stack(lc)
    out = {"preset": preset, "batch": batch, "steps": steps,
           "vs_torch_bf16": logit_agreement(la, lb, 3e-2), "vs_pyvm": logit_agreement(lc, lb, 1e-3),
           "smallest_routing_margin": margins.smallest}
    greedy = SamplingParams(greedy=True)
    b = Engine(cfg, w, executor="mega", max_batch=batch, max_seq_len=tokens + 16).generate(prompts, tokens, greedy,
                                                                                          stop_at_eos=False)
    w32 = {k: v.float() if v.is_floating_point() else v for k, v in w.items()}
    for name, ws in (("torch_bf16", w), ("torch_fp32", w32)):
        a = Engine(cfg, ws, executor="torch", max_batch=batch, max_seq_len=tokens + 16).generate(
            prompts, tokens, greedy, stop_at_eos=False)
        out[name] = {"equal": sum(x == y for ra, rb in zip(a.token_ids, b.token_ids) for x, y in zip(ra, rb)),
                     "tokens": sum(len(r) for r in a.token_ids),
                     "first_divergence": [next((j for j, (x, y) in enumerate(zip(ra, rb)) if x != y), None)
                                          for ra, rb in zip(a.token_ids, b.token_ids)]}
    return out


def diff_failures(r: dict) -> list[str]:
    """Why a `diff_program` row fails (empty: it passes): a launch error, a buffer over BUFFER_TOL or mismatched,
    a repeat or a delayed build that differs."""
    if "error" in r:
        return [f"error: {r['error']}"]
    why = []
    over = sorted((x for x in r["buffers"] if not x.get("rel", 0.0) < BUFFER_TOL), key=lambda x: -x["rel"])
    if over:
        why.append("over " + f"{BUFFER_TOL:g}: " + ", ".join(f"{x['buffer']} {x['rel']:.1e}" for x in over[:4]))
    if r["mismatched"]:
        why.append(f"mismatched: {', '.join(r['mismatched'][:6])}")
    if not r["repeat_bitwise_equal"]:
        why.append("a repeated launch differs")
    if not r["delayed_bitwise_equal"]:
        why.append("a delayed build differs")
    return why


def e2e_failures(r: dict) -> list[str]:
    """Why an `end_to_end` row fails against pyvm (empty: it passes): an error, non-finite logits, a row-step
    E2E_PYVM_TOL or more off, a clear token that differs. Against bf16 torch the agreement is statistical (routing
    near ties, near_tie.py): the GPU test asserts it, this does not."""
    if "error" in r:
        return [f"error: {r['error']}"]
    vp = r["vs_pyvm"]
    why = []
    if not vp["finite"]:
        why.append("non-finite logits")
    if not vp["worst"] < E2E_PYVM_TOL:
        why.append(f"logits {vp['worst']:.1e} from pyvm (tolerance {E2E_PYVM_TOL:g})")
    if vp["clear_token_mismatches"]:
        why.append(f"{vp['clear_token_mismatches']} clear tokens differ from pyvm's")
    return why
