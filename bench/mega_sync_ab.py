"""The megakernel's persistent loop and synchronisation steps against alternatives, by launch time on the GPU. Each
variant is a build of the kernel with one of cute_kernel.py's module-level steps swapped for one compile (the way
validate/mega_plants.py swaps in its planted mistakes; the shipped source holds no switch), each alternative a
correct one under the PTX memory model, and each first checked against pyvm (validate.mega_gpu.diff_program on
tiny-qwen3-moe at --check-batch (1 and 3), delayed launches included). Then per preset and batch every variant's
launch is timed in interleaved rounds (one launch of each variant a round, CUDA events around each), so that the
GPU's drift within the call falls on all of them alike (K3's experts in the order the mega executor holds them); the
medians are written to --out as JSON.

    python bench/mega_sync_ab.py --preset qwen3-30b-a3b,k3-mini --batch 1,8 --out $OUT/mega-sync-ab.json
    git show 8da66e1:megadecode/backends/mega/cute_kernel.py > /tmp/loop.py
    python bench/mega_sync_ab.py --loop-from /tmp/loop.py --variants loop,shipped ...

The builds are compiled at once in spawned worker processes (`--jobs`; a variant's compile is ~50-80 s of one
CPU, the GPU machine has 16), each exported to a temporary directory as the kernel's disk cache stores an entry
and loaded back here; `--jobs 1` compiles them one after another in this process.

Variants:
- `shipped`: the wait polls with `ld.acquire.gpu` and the block barrier follows; the signal is the release add
  after the body's block barrier; the next instruction's row is copied into shared memory while one runs.
- `relaxed_poll`: one acquire load; while the counter is short, relaxed polls (no L1 invalidation), then one
  acquire load once it reached the target (the acquire reads a value at or past the target: it synchronises with
  the releases that produced it).
- `fenced_signal`: a `fence.acq_rel.gpu` before the signal's release add (the signal up to 8da66e1).
- `cta_copies` (the ring build): the loader's bulk copies name their destination `.shared::cta` rather than
  `.shared::cluster` (PTX 8.6; the same CTA's shared memory either way, the kernel runs without clusters): does a
  release's MEMBAR / CGAERRBAR wait for the loader's copies in flight? (a staged MATVEC's signal takes ~3.3 us while
  its loader streams the next pages, ~1 us when it does not)
- `inflightN` (the ring build; N = 1, 3, 4 or 10 = every slot, the loader before base.RING_INFLIGHT): the loader
  keeps at most N pages in flight (shipped: 2) — the stream's own rate against the queue its burst puts in front of
  the latency-bound loads of the phases that run meanwhile.
- `poll_every`: the wait reads the launch's abort flag (err[0], one word every spinning CTA polls) at every poll of its
  counter (shipped: every cute_kernel.ABORT_POLL polls).
- `poll_sleep`: and a `nanosleep.u32 100` between polls (fewer polls of the counters' lines, which every spinner and
  every signal of a phase share; the wait sees its counter up to ~0.1 us later).
- `before`: `poll_every` and `inflight10` in one build, the loop and loader these two replaced.
- `loop`: the persistent loop and synchronisation steps of another cute_kernel.py (`--loop-from`, e.g. an earlier
  commit's, read with `git show`) around today's opcode bodies: a loop change measured against the loop it replaces.
- `attn_l2`: before an ATTN_GQA instruction's wait (while q/k/v are computed), its threads request the split's key
  and value rows of the positions before the token's own into L2 (`prefetch.global.L2`, a line a thread): those rows
  were written by earlier launches and are static in this one. Why: the split's chunk took 5.0 us the first time
  and 3.4 us again with its rows in L2 (bench/mega_icache_probe.py, qwen3-30b-a3b batch 1 on the H200), so ~1.6 us
  of each layer's attention phase is the rows' HBM trip. The static audit flags the variant's two reads of the
  step's positions and slots before the wait (the i32 arena, where the host writes them before the launch): a
  landing version would give the step's inputs a region the audit knows is static within the launch.

      python bench/mega_sync_ab.py --preset qwen3-30b-a3b --batch 1 --variants shipped,attn_l2 --check-batch 1,3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from megadecode.backends import expert_layout
from megadecode.backends.mega.executor import default_ctas, frag_order
from megadecode.backends.mega.lower import lower
from megadecode.backends.mega import kernel_cache
from megadecode.backends.mega.runtime import Launcher, compile_launcher, cubin_registers, ring_build
from megadecode.backends.mega.schedule import schedule
from megadecode.cache import KVCache
from megadecode.plan import build_plan
from megadecode.presets import preset_config
from megadecode.validate.mega_gpu import diff_failures, diff_program
from megadecode.weights import random_weights
from mega_timeline import _runtime  # bench/: one step's inputs set, compiled and warmed, as the timelines take it

VARIANTS = ("shipped", "relaxed_poll", "fenced_signal", "cta_copies", "inflight1", "inflight3", "inflight4",
            "inflight10", "poll_every", "poll_sleep", "before", "loop", "attn_l2")
LOOP_FROM = None  # --loop-from: the cute_kernel.py whose loop the `loop` variant builds


def _swaps(name: str) -> list[tuple[object, str, object]]:
    import cutlass.cute as cute
    from cutlass import Int32

    from megadecode.backends.mega import cute_kernel as K
    from megadecode.backends.mega.cute import base as B

    acquire = K.wait_load
    record = K.record_timeout

    @cute.jit
    def wait_counter_relaxed_poll(ctr: cute.Tensor, err: cute.Tensor, c_idx: Int32, need: Int32, per: Int32,
                                  epoch: Int32, max_spin: Int32, instr: Int32) -> Int32:
        ok = Int32(1)
        if c_idx >= 0:
            target = (epoch - 1) * per + need
            p = (ctr.iterator + c_idx).llvm_ptr
            v = acquire(p)
            if (v - target) < 0:
                spins = Int32(0)
                aborted = Int32(0)
                while (v - target) < 0 and spins < max_spin and aborted == 0:
                    v = cute.arch.load(p, Int32, sem="relaxed", scope="gpu")
                    aborted = cute.arch.load(err.iterator.llvm_ptr, Int32, sem="relaxed", scope="gpu")
                    spins += 1
                v = acquire(p)
            if (v - target) < 0:
                ok = Int32(0)
                record(err, instr, c_idx, v, target)
        return ok

    @cute.jit
    def signal_fenced(ctr: cute.Tensor, sig: Int32):
        cute.arch.fence_acq_rel_gpu()
        cute.arch.atomic_add((ctr.iterator + sig).llvm_ptr, Int32(1), sem="release", scope="gpu")

    if name == "loop":
        return [(K, "mega_kernel", _loop_module().mega_kernel)]
    if name == "attn_l2":
        return [(K, "mega_kernel", _attn_l2_module().mega_kernel)]
    if name == "before":
        return _swaps("poll_every") + _swaps("inflight10")
    if name in ("poll_every", "poll_sleep"):
        return [(K, "wait_counter", _wait_counter(name == "poll_sleep"))]
    if name.startswith("inflight"):
        return [(B, "RING_INFLIGHT", int(name[len("inflight"):]))]
    if name == "cta_copies":
        return [(B, "issue_page", _issue_page_cta())]
    return {"shipped": [], "relaxed_poll": [(K, "wait_counter", wait_counter_relaxed_poll)],
            "fenced_signal": [(K, "signal", signal_fenced)]}[name]


def _wait_counter(sleep: bool):
    """cute_kernel.wait_counter reading the abort flag at every poll (poll_every), or every ABORT_POLL polls with a
    100 ns sleep between polls (poll_sleep)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32

    from megadecode.backends.mega import cute_kernel as K

    every = K.ABORT_POLL if sleep else 1
    record = K.record_timeout

    @cute.jit
    def wait_counter(ctr: cute.Tensor, err: cute.Tensor, c_idx: Int32, need: Int32, per: Int32, epoch: Int32,
                     max_spin: Int32, instr: Int32) -> Int32:
        ok = Int32(1)
        if c_idx >= 0:
            target = (epoch - 1) * per + need
            p = (ctr.iterator + c_idx).llvm_ptr
            v = K.wait_load(p)
            spins = Int32(0)
            aborted = Int32(0)
            while (v - target) < 0 and spins < max_spin and aborted == 0:
                if cutlass.const_expr(sleep):
                    cute.arch.inline_ptx("nanosleep.u32 100;")
                v = K.wait_load(p)
                if spins % every == every - 1:
                    aborted = cute.arch.load(err.iterator.llvm_ptr, Int32, sem="relaxed", scope="gpu")
                spins += 1
            if (v - target) < 0:
                ok = Int32(0)
                if aborted == 0:
                    record(err, instr, c_idx, v, target)
        return ok

    return wait_counter


def _issue_page_cta():
    """base.issue_page with its bulk copy's destination `.shared::cta`: the shipped one's text otherwise."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32, Int64

    from megadecode.backends.mega.cute import base as B

    @cute.jit
    def issue_page(smi: cute.Tensor, n: Int32, src: Int64, sz: Int32, lim: Int32, j: Int32, delay_ns: Int32,
                   epoch: Int32, bid: Int32):
        freed_at = Int32(smi.iterator.toint()) + (B.RING_S + 3) * 4
        spins = Int32(0)
        stop = Int32(0)
        while n - B.ld_acquire_shared(freed_at) >= B.RING_SLOTS and stop == 0:
            cute.arch.inline_ptx("nanosleep.u32 64;")
            spins += 1
            if spins > lim:
                B.report_ring_timeout(smi, j, Int32(-3), n)
                stop = Int32(1)
            elif B.aborted(smi) != 0:
                stop = Int32(1)
        if cutlass.const_expr(B.RING_INFLIGHT < B.RING_SLOTS):
            if n >= B.RING_INFLIGHT and stop == 0:
                m = n - B.RING_INFLIGHT
                mb0 = smi[B.RING_S + 6] + (m % B.RING_SLOTS) * 8
                while B.page_landed(mb0, (m // B.RING_SLOTS) & 1) == 0 and stop == 0:
                    spins += 1
                    if spins > lim:
                        B.report_ring_timeout(smi, j, Int32(-3), n)
                        stop = Int32(1)
                    elif B.aborted(smi) != 0:
                        stop = Int32(1)
        if stop == 0:
            if delay_ns > 0:
                B.nap(delay_ns, n, epoch, bid * 4 + 3)
            slot = n % B.RING_SLOTS
            mb = smi[B.RING_S + 6] + slot * 8
            cute.arch.inline_ptx("mbarrier.arrive.expect_tx.shared::cta.b64 _, [{$r0}], {$r1};",
                                 read_only_args=[mb, sz])
            cute.arch.inline_ptx("cp.async.bulk.shared::cta.global.mbarrier::complete_tx::bytes [{$r0}], [{$r1}], "
                                 "{$r2}, [{$r3}];",
                                 read_only_args=[smi[B.RING_S + 5] + slot * B.RING_PAGE, src, sz, mb])
            n += 1
        return n, stop

    return issue_page


def module_from_file(name: str, path: str | None, option: str, what: str):
    """The file at `path` imported once as module `name` (a dotted name inside megadecode's package, so that its
    relative imports resolve beside the file it stands for); without a path, the one-line error naming `option`."""
    import importlib.util
    import sys

    if name not in sys.modules:
        if path is None:
            raise SystemExit(f"this variant needs {option} FILE ({what}, e.g. from git show)")
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


# attn_l2: the persistent loop with one step added before an ATTN_GQA instruction's wait (inserted into the shipped
# cute_kernel.py's source, so the variant is today's loop plus that step)
ATTN_L2_AT = "        t_wait = Int64(0)\n"
ATTN_L2_STEP = """        if smi[ROW_S] == OPCODES["ATTN_GQA"] and (smi[ROW_S + 3] & (F_KV_READ | F_KV_WRITE)) == 0:
            attn_l2_prefetch(ib, ptab, smi, tid)
"""
ATTN_L2_HELPER = '''

from .cute.attention import split_bounds  # noqa: E402
from .cute.base import ARG, arg, ia, ldi  # noqa: E402
from .isa import F_KV_READ, F_KV_WRITE  # noqa: E402


@cute.jit
def attn_l2_prefetch(ib: Int64, ptab: cute.Tensor, smi: cute.Tensor, tid: Int32):
    """Before the wait: the split's key and value rows of the positions before the token's own (written by earlier
    launches, static in this one) requested into L2, one 128-byte line a thread at a time."""
    A = "ATTN_GQA"
    kc, vc = ptab[arg(smi, ARG[A]["kc"])], ptab[arg(smi, ARG[A]["vc"])]
    b, h, s, S, KH, d, Lmax = (arg(smi, ARG[A][n]) for n in ("b", "h", "s", "S", "KH", "d", "Lmax"))
    pos = ldi(ia(ib, arg(smi, ARG[A]["pos_off"]) + b))  # the step's inputs: written before the launch
    slot = ldi(ia(ib, arg(smi, ARG[A]["slot_off"]) + b))
    lo, hi = split_bounds(s, S, pos)
    hi = cutlass.min(hi, pos)
    rowb = (Int64(slot) * Int64(Lmax) * Int64(KH) + Int64(h)) * Int64(d) * 2
    rstride = Int64(KH) * Int64(d) * 2
    lines = (d * 2 + 127) // 128
    n = cutlass.max(hi - lo, 0) * lines
    for e in cutlass.range(tid, 2 * n, NT):
        r = (e % n) // lines
        base = kc
        if e >= n:
            base = vc
        addr = base + rowb + Int64(lo + r) * rstride + Int64((e % lines) * 128)
        cute.arch.inline_ptx("prefetch.global.L2 [{$r0}];", read_only_args=[addr])
'''


def _attn_l2_module():
    """The shipped cute_kernel.py with ATTN_L2_STEP before each instruction's wait, as a module beside it."""
    from megadecode.backends.mega import cute_kernel as K

    return edited_module("megadecode.backends.mega._attn_l2", K, [(ATTN_L2_AT, ATTN_L2_STEP + ATTN_L2_AT)],
                         "attn_l2", tail=ATTN_L2_HELPER)


def edited_module(name: str, of, edits: list[tuple[str, str]], variant: str, tail: str = ""):
    """Module `of`'s source with each (old, new) edit made (each old text found exactly once, else the variant
    stops with a one-line error: the shipped source changed under it) and `tail` appended, written to a temporary
    file and imported as `name` (in `of`'s package, so its relative imports resolve as `of`'s); built once a
    process (each build's swaps ask again)."""
    import sys
    import tempfile
    from pathlib import Path

    if name in sys.modules:
        return sys.modules[name]
    src = Path(of.__file__).read_text()
    for old, new in edits:
        if src.count(old) != 1:
            raise SystemExit(f"{variant}: {Path(of.__file__).name} changed; the variant's edit point is not unique")
        src = src.replace(old, new)
    path = Path(tempfile.mkdtemp(prefix=f"megadecode-{variant}-")) / Path(of.__file__).name
    path.write_text(src + tail)
    return module_from_file(name, str(path), "", "")


def _loop_module():
    """LOOP_FROM's source as a module beside cute_kernel.py (its relative imports resolve to today's bodies): its
    mega_kernel, traced in place of today's, calls its own synchronisation steps and today's BODIES."""
    return module_from_file("megadecode.backends.mega._loop_from", LOOP_FROM, "--loop-from", "a cute_kernel.py")


@contextlib.contextmanager
def swapped(swaps: list[tuple[object, str, object]]):
    """(module, attribute, replacement) set for the block, then restored (a build traces the replacements)."""
    saved = [(m, a, getattr(m, a)) for m, a, _ in swaps]
    try:
        for m, a, new in swaps:
            setattr(m, a, new)
        yield
    finally:
        for m, a, old in reversed(saved):
            setattr(m, a, old)


def build(name: str, device, ring: bool = True):
    with swapped(_swaps(name)):
        return compile_launcher(device, cache=False, ring=ring)


def timed(preset: str, batch: int, context: int, kernels: dict, rounds: int) -> dict:
    """Every variant's build of the batch (kernels[name, ring]: ring_build(batch)'s, as the executor runs it, on as
    many CTAs as that build holds), launched in interleaved rounds: median and min us."""
    cfg = preset_config(preset)
    w = random_weights(cfg, "cuda", torch.bfloat16, 0)
    w = expert_layout.take(w, build_plan(cfg), frag_order(cfg, "cuda"))  # K3's experts as the mega executor holds them
    cache = KVCache(cfg, batch, context + 8, "cuda", torch.bfloat16)
    for parts in cache.layers.values():
        for t in parts:
            t.normal_()
    ring = ring_build(batch)
    ctas = default_ctas(torch.device("cuda"), ring)
    prog = schedule(lower(cfg, w, cache, batch, ctas), ctas)
    rts = {n: _runtime(prog, batch, context, kernel=k, ring=ring) for (n, r), k in kernels.items() if r == ring}
    med, mins = interleaved(rts, rounds)
    del rts, prog, cache, w
    torch.cuda.empty_cache()
    return {"preset": preset, "batch": batch, "context": context, "ctas": ctas, "rounds": rounds,
            "median_us": med, "min_us": mins}


def interleaved(rts: dict, rounds: int) -> tuple[dict, dict]:
    """One launch of each runtime a round, CUDA events around each, for `rounds` rounds (the GPU's drift within
    the call falls on all of them alike); then each runtime's error check. Median and min us per name."""
    ts = {n: [] for n in rts}
    for _ in range(rounds):
        for n, rt in rts.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            rt.launch()
            b.record()
            b.synchronize()
            ts[n].append(a.elapsed_time(b) * 1e3)
    for rt in rts.values():
        rt.check()
    return {n: sorted(v)[len(v) // 2] for n, v in ts.items()}, {n: min(v) for n, v in ts.items()}


def ab_parser(preset: str, batch: str, rounds: int, variants: str, out: str,
              builds: bool = True) -> argparse.ArgumentParser:
    """The A/B benches' common options (this one's, mega_body_ab's and mega_lower_ab's), with their defaults;
    `builds`: the script compiles a build a variant (--jobs), which mega_lower_ab, one kernel for every variant, does
    not."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default=preset)
    ap.add_argument("--batch", default=batch)
    ap.add_argument("--check-batch", default="1,3",
                    help="batches each variant is diffed against pyvm at before it is timed (a variant that changes "
                         "what runs past batch 8 wants one there: 1,3,17)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--variants", default=variants)
    ap.add_argument("--out", default=out)
    if builds:
        ap.add_argument("--jobs", type=int, default=0,
                        help="variant builds compiled at once, each in its own process (0: one a variant and build, "
                             "at most half the CPUs and 8; 1: one after another in this process)")
    return ap


def ab_variants(ap: argparse.ArgumentParser, args, known: tuple[str, ...], joins: bool = False) -> list[str]:
    """--variants as a list, every name one of `known` (with `joins`, or parts of them joined by `+`, which the
    caller's swaps build as one), else the parser's one-line error."""
    names = args.variants.split(",")
    unknown = {n for n in names if not (n in known or joins and set(n.split("+")) <= set(known) - {"shipped"})}
    if unknown:
        also = " (or parts joined by +)" if joins else ""
        ap.error(f"unknown variants {sorted(unknown)}: {', '.join(known)}{also}")
    return names


def main(argv=None) -> int:
    ap = ab_parser("qwen3-30b-a3b,k3-mini", "1,8", 30, "shipped,relaxed_poll,fenced_signal", "mega-sync-ab.json")
    ap.add_argument("--loop-from", help="the cute_kernel.py whose persistent loop the `loop` variant builds")
    args = ap.parse_args(argv)
    global LOOP_FROM
    LOOP_FROM = args.loop_from
    names = ab_variants(ap, args, VARIANTS)
    out = run_ab(names, build, "tiny-qwen3-moe", args.preset, args.batch, args.context, args.rounds, args.out,
                 args.check_batch, jobs=args.jobs, settings={"LOOP_FROM": args.loop_from}, loop_from=args.loop_from)
    ok = all(not c["failures"] for c in out["checks"])
    print(f"wrote {args.out}; every variant {'passes' if ok else 'does NOT pass'} its check")
    return 0 if ok else 1


def build_key(name: str, ring: bool) -> str:
    """A variant build's entry name under a parallel build's directory."""
    return f"{name}.{'ring' if ring else 'two_cta'}"


def _build_export(build, settings: dict, name: str, ring: bool, root: str, device: str = "cuda") -> dict:
    """In a worker process: `build(name, device, ring)` (the caller module's, its module-level options `settings`
    set first, as its main() sets them in the parent) exported into `root` as the kernel's disk cache lays out an
    entry (kernel_cache.store), under build_key. None for a build the runtimes make themselves (`shipped`)."""
    build.__globals__.update(settings)
    t0 = time.perf_counter()
    fn = build(name, torch.device(device), ring)
    if fn is None:
        return {"key": None, "compile_s": 0.0}
    registers = cubin_registers(getattr(fn.artifacts, "CUBIN", None))
    key = build_key(name, ring)
    if not kernel_cache.store(Path(root), key, fn, registers):
        raise RuntimeError(f"the build of {name} could not be exported (said above)")
    return {"key": key, "registers": registers, "compile_s": round(time.perf_counter() - t0, 1)}


def default_jobs(builds: int) -> int:
    """Parallel compiles when --jobs is 0: one a build, at most half the CPUs (the compiles are single-threaded
    tracing and ptxas; the other half is left to the rest of the machine) and 8."""
    return max(1, min(builds, (os.cpu_count() or 2) // 2, 8))


def prebuilt(build, settings: dict, names: list[str], rings: list[bool], jobs: int, device: str = "cuda") -> dict:
    """Every (variant, ring) build compiled at once in `jobs` spawned processes (each variant's compile is ~50-80 s
    of one CPU on the GPU machine, so five variants cost ~5 minutes one after another and ~1.5 at once), each
    exported to a temporary directory and loaded here (kernel_cache.load: the launcher the executor's cache hits
    run). {(name, ring): Launcher, or None for `shipped`}; a build that failed in its worker is left out and said in
    one line, so the caller compiles it in this process (a failure there is the real error, raised)."""
    root = tempfile.mkdtemp(prefix="mega-ab-builds-")
    todo = [(n, r) for n in names for r in rings]
    ctx = multiprocessing.get_context("spawn")  # a CUDA process must not fork
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as ex:
        futs = {nr: ex.submit(_build_export, build, settings, nr[0], nr[1], root, device) for nr in todo}
        done = {}
        for (n, r), f in futs.items():
            try:
                done[n, r] = f.result()
            except Exception as e:  # noqa: BLE001 (the in-process compile that follows raises the real error)
                print(f"parallel build of {build_key(n, r)} failed ({kernel_cache.why(e)}); compiling it here",
                      flush=True)
    kernels = {}
    for (n, r), res in done.items():
        if res["key"] is None:
            kernels[n, r] = None
            continue
        hit = kernel_cache.load(Path(root), res["key"])
        if hit is not None:
            (module, fn), registers = hit
            kernels[n, r] = Launcher(fn, registers, "cache", keep=module, ring=r)
            kernels[n, r].compile_s = res["compile_s"]
    return kernels


def run_ab(names: list[str], build, check_preset: str, presets: str, batches: str, context: int, rounds: int,
           path: str, check_batches: str = "1,3", jobs: int = 1, settings: dict | None = None, **extra) -> dict:
    """Each variant built (`build(name, device, ring)`: each build the batches run, runtime.ring_build: the ring
    build at batch 1, the two-CTA build past it; with `jobs` != 1 the builds compiled at once in worker processes,
    `prebuilt`, the build module's `settings` set in each), diffed against pyvm on `check_preset` at each of
    `check_batches` (every buffer, repeats and delayed launches), then every variant timed together per preset and
    batch (`timed`); the results (`extra` beside them) written to `path` after the checks and after each run, and
    returned."""
    dev = torch.device("cuda")
    out = {"gpu": torch.cuda.get_device_name(), "git_sha": os.environ.get("MEGADECODE_GIT_SHA"), **extra,
           "compile_s": {}, "checks": [], "runs": []}
    rings = sorted({ring_build(int(b)) for b in f"{batches},{check_batches}".split(",")})
    kernels = {}
    if jobs != 1:
        jobs = jobs or default_jobs(len(names) * len(rings))
        t0 = time.perf_counter()
        kernels = prebuilt(build, settings or {}, names, rings, jobs)
        out["parallel_build"] = {"jobs": jobs, "wall_s": round(time.perf_counter() - t0, 1)}
        print(f"{len(kernels)} of {len(names) * len(rings)} builds compiled in {jobs} processes in "
              f"{out['parallel_build']['wall_s']} s", flush=True)
    for n in names:
        t0 = time.perf_counter()
        for ring in rings:
            if (n, ring) not in kernels:
                kernels[n, ring] = build(n, dev, ring)
        own = time.perf_counter() - t0
        out["compile_s"][n] = round(max([own] + [getattr(kernels[n, r], "compile_s", 0.0) for r in rings]), 1)
        for b in map(int, check_batches.split(",")):
            r = diff_program(check_preset, b, 16, seed=b, kernel=kernels[n, ring_build(b)], ring=ring_build(b))
            worst = max((x.get("rel", 0.0) for x in r.get("buffers", [])), default=None)
            out["checks"].append({"variant": n, "batch": b, "failures": diff_failures(r), "worst_rel": worst})
            print(f"check {n} b={b}: {diff_failures(r) or 'pass'} (worst rel {worst})", flush=True)
        with open(path, "w") as f:  # a call cut short keeps the compiles and checks
            json.dump(out, f, indent=1)
    for p in presets.split(","):
        for b in map(int, batches.split(",")):
            try:
                r = timed(p, b, context, kernels, rounds)
            except torch.cuda.OutOfMemoryError as e:  # a preset too big for this card (k3-mini on an H100): the
                # others still run; the row says why this one has no times
                torch.cuda.empty_cache()
                r = {"preset": p, "batch": b, "context": context, "skipped": f"out of GPU memory: {e}".splitlines()[0]}
                out["runs"].append(r)
                print(f"{p} b={b}: skipped ({r['skipped']})", flush=True)
                continue
            out["runs"].append(r)
            print(f"{p} b={b}: " + "  ".join(f"{n} {v:.0f} us" for n, v in r["median_us"].items()), flush=True)
            with open(path, "w") as f:
                json.dump(out, f, indent=1)
    return out

if __name__ == "__main__":
    raise SystemExit(main())
