"""The megakernel's lowering choices against alternatives, by launch time on the GPU, with one build of the kernel:
each variant is the lowering (backends/mega/layers.py) with module-level choices swapped while its programs are
built (the shipped source holds no switch), each first diffed against pyvm (validate.mega_gpu.diff_program on
tiny-qwen3-moe and tiny-deepseek-v3 at --check-batch (1 and 3), delayed launches included), then every variant's
program timed in interleaved rounds per preset and batch (one launch of each a round, CUDA events around each), so
that the GPU's drift within the call falls on all of them alike. Medians to --out as JSON, with each variant's
instruction count.

    python bench/mega_lower_ab.py --preset qwen3-30b-a3b --batch 1,2,4,8 --out $OUT/mega-lower-ab.json

A variant is a list of (module, name, replacement) swaps (`_swaps`); `shipped` is the lowering as it is. Variants:
- `pair1_16`, `pair1_64`: bf16 EXPERT_UP takes one (expert, token) pair a pass (F_PAIR1, isa.up_passes) up to batch
  16 / 64, where the shipped lowering stops at 8 (isa.PAIR1_MAX_B): past 8 an item's passes of several pairs run the
  general loop, which at batch 8 took 1.8-2.0x a single-pair item's time for the same rows; the megakernel is 1.7x
  `fused`'s step at qwen3-30b-a3b batch 16 and 3.2x at 64. Diff them past batch 8 (`--check-batch 1,3,17`):

      python bench/mega_lower_ab.py --variants shipped,pair1_16,pair1_64 --check-batch 1,3,17 --batch 16,64

- `route_phase`: a qwen3-moe batch-1 layer routes in a ROUTE phase (one instruction, its picks by rank: cute/moe.py
  route_one) where the shipped lowering routes inside every EXPERT_UP item (F_ROUTE, isa.ROUTE_IN_UP_MAX_B):

      python bench/mega_lower_ab.py --variants shipped,route_phase --batch 1 --check-batch 1,3

- `splits_ceil`: attention's splits capped at ceil(cache length / 64) where the shipped lowering caps them at the
  floor (builder.Builder.splits): a cache of `--context` 1024 + 8 then takes 17 splits, not 16. Why: the kernel folds
  a split's positions in chunks of 64 (cute/attention.py CH) and a launch at position 1024 holds 1025 of them, so
  one of 16 splits (the last, which also writes the token's key and value) takes 65 positions, two chunks, and the
  phase waits for it; with 17 every split is one chunk.
- `splits32`: capped at ceil(cache length / 32): 33 splits of <= 32 positions at batch 1 (about one instruction a
  CTA, 4 KV heads x 33), each chunk half full, MERGE adding twice the partials.

      python bench/mega_lower_ab.py --variants shipped,splits_ceil,splits32 --batch 1,8 --check-batch 1,3

- `route_one`: one ROUTE instruction, scores, picks and tables on one CTA, at every batch, where the shipped lowering
  splits the picks past ROUTE_SPLIT_B tokens into instructions of ROUTE_TOKENS tokens on as many CTAs (F_PICKS) and
  the tables into one instruction after them (F_TABLES):

      python bench/mega_lower_ab.py --variants shipped,route_one --batch 17,64 --check-batch 17,33

- `router_whole`: the router's tiles each over the whole batch, where the shipped lowering runs them once per chunk
  of about ROUTER_TOKENS tokens past that many (layers.moe_layer, Builder.matvec's chunk_tokens):

      python bench/mega_lower_ab.py --variants shipped,router_whole --batch 17,64 --check-batch 17,33

- `mv_rows32`, `mv_rows64`: MATVEC tiles of at least 32 / 64 rows from batch 2 (builder.MIN_ROWS; shipped 16). On
  the tensor cores a tile is taken in row groups of 16 (the mma's M), each of which reads every token's input over
  the whole K: the input's bytes from L2 are (batch / 8) x the rows' own a row group, and a tile of 20 rows (q_proj
  at 264 CTAs) is two row groups, the second a quarter full. Fewer, fuller tiles read the input fewer times:

      python bench/mega_lower_ab.py --variants shipped,mv_rows32,mv_rows64 --batch 17,64,8 --check-batch 17,33

  Measured at 6f6d217 on an H100: slower at every batch (b8 / 17 / 64: 15862 / 27675 / 42764 us shipped, 15887 /
  28045 / 44677 mv_rows32, 17207 / 30437 / 49602 mv_rows64; bench/results/mega-lower-ab-mv-rows-nvidia-h100.json).

- `lm_per12`, `lm_per36`: the lm_head in 12 / 36 tiles a CTA (lower.LM_PER; shipped 4: 144 rows a tile at
  qwen3-30b-a3b on 264 CTAs, 9 row groups; 48 and 16 rows). Past 8 tokens the tensor-core loop passes over a
  tile's rows once per 8 tokens, and the 264 tiles of 590 KB a CTA holds at once are more than L2 holds: the
  timelines at 6e8674e show the lm_head at 732 us of batch 17's step and 1917 us of batch 64's (19% / 7% of the
  HBM's rate for its 622 MB). Smaller tiles keep the live rows in L2 across the passes, at more instructions a
  CTA:

      python bench/mega_lower_ab.py --variants shipped,lm_per12,lm_per36 --batch 17,64,8 --check-batch 17,33

- `qkv_shared`: q, k and v tiled with one rows-per-tile for the three, where the shipped lowering tiles them jointly
  (layers.qkv_rows): at qwen3-30b-a3b batch 1 that made 134 instructions on 132 CTAs, two CTAs running two.

      python bench/mega_lower_ab.py --variants shipped,qkv_shared --batch 1 --check-batch 1,3

- `group_off`: bf16 experts past PAIR1_MAX_B tokens in PASS-pair passes on the CUDA cores (EXPERT_DOWN's row tiles
  of every pair, the combine fused), where the shipped lowering groups them on the tensor cores from GROUP_MIN_B
  (F_GROUP: each selected expert's 16-row tiles against 8 of its pairs, EXPERT_DOWN pair-major, then COMBINE);
  `group_9`: grouped from 9 tokens (one pair a pass, F_PAIR1, up to 8).

      python bench/mega_lower_ab.py --variants shipped,group_off,group_9 --batch 16,17,64 --check-batch 1,3,17

Measured so
far (docs/megakernel.md, "bf16 EXPERT_DOWN pair-major, measured and reverted"): at 94741e0 bf16 EXPERT_DOWN
pair-major up to 8 tokens with COMBINE after it against the row tiles of every pair (`down_rows`), slower at every
batch 1-8 on qwen3-30b-a3b (bench/results/mega-lower-ab-nvidia-h200.json); its lowering and body are in git
(`git show 94741e0`).
"""

from __future__ import annotations

import json
import os
import time

import torch

from megadecode.backends import expert_layout
from megadecode.backends.mega.executor import default_ctas, frag_order
from megadecode.backends.mega.lower import lower
from megadecode.backends.mega.runtime import compiled_launcher, ring_build
from megadecode.backends.mega.schedule import schedule
from megadecode.cache import KVCache
from megadecode.plan import build_plan
from megadecode.presets import preset_config
from megadecode.validate.mega_gpu import diff_failures, diff_program
from megadecode.weights import random_weights
from mega_sync_ab import ab_parser, ab_variants, interleaved, swapped  # bench/: options, timing, swaps
from mega_timeline import _runtime  # bench/: one step's inputs set, compiled and warmed

VARIANTS = ("shipped", "pair1_16", "pair1_64", "route_phase", "splits_ceil", "splits32", "qkv_shared",
            "group_off", "group_9", "route_one", "router_whole", "mv_rows32", "mv_rows64",
            "lm_per12", "lm_per36")
CHECK_PRESETS = ("tiny-qwen3-moe", "tiny-deepseek-v3")


def _swaps(name: str) -> list[tuple[object, str, object]]:
    """The variant's swaps of layers.py's module-level choices (none for `shipped`)."""
    from megadecode.backends.mega import layers

    if name == "shipped":
        return []
    if name in ("pair1_16", "pair1_64"):  # bf16 EXPERT_UP one pair a pass (F_PAIR1) up to batch 16 / 64
        return [(layers, "PAIR1_MAX_B", int(name.split("_")[1]))]
    if name == "route_phase":  # batch 1's routing as a ROUTE phase again (its picks by rank), not inside EXPERT_UP
        return [(layers, "ROUTE_IN_UP_MAX_B", 0)]
    if name in ("splits_ceil", "splits32"):  # attention's splits: every one a single chunk at the cache's length
        from megadecode.backends.mega.builder import Builder

        per = 64 if name == "splits_ceil" else 32

        def splits(self, units: int) -> int:
            return max(1, min(64, -(-self.cache.max_len // per), round(self.ctas / max(1, units))))

        return [(Builder, "splits", splits)]
    if name == "group_off":  # no F_GROUP: the CUDA-core pass loop and the fused combine at every batch
        return [(layers, "GROUP_MIN_B", 1 << 30)]
    if name == "router_whole":  # the router's tiles over the whole batch (8 instructions at qwen3-30b-a3b)
        return [(layers, "ROUTER_TOKENS", 1 << 30)]
    if name == "route_one":  # one ROUTE instruction at every batch (no F_PICKS phase)
        return [(layers, "ROUTE_SPLIT_B", 1 << 30)]
    if name == "group_9":  # F_GROUP from 9 tokens (layers: F_GROUP before F_PAIR1)
        return [(layers, "GROUP_MIN_B", 9)]
    if name == "qkv_shared":  # q, k and v tiled with one rows-per-tile for the three (134 tiles on 132 CTAs)
        def shared(b, H: int, KH: int, d: int) -> list[int]:
            return [b.rows_per_tile((H + 2 * KH) * d)] * 3

        return [(layers, "qkv_rows", shared)]
    if name in ("mv_rows32", "mv_rows64"):  # MATVEC tiles of at least 32 / 64 rows from batch 2 (builder.MIN_ROWS)
        from megadecode.backends.mega import builder

        return [(builder, "MIN_ROWS", int(name[len("mv_rows"):]))]
    if name in ("lm_per12", "lm_per36"):  # lm_head tiles a CTA (lower.LM_PER; shipped 4)
        from megadecode.backends.mega import lower as L

        return [(L, "LM_PER", float(name[len("lm_per"):]))]
    raise ValueError(f"unknown variant {name!r}")



def timed(preset: str, cfg, w, batch: int, context: int, names: list[str], rounds: int) -> dict:
    """Every variant's program of `cfg` at `batch` (weights `w`), launched in interleaved rounds: median and min us.
    The build the executor runs at this batch (runtime.ring_build) on as many CTAs as it holds."""
    cache = KVCache(cfg, batch, context + 8, "cuda", torch.bfloat16)
    for parts in cache.layers.values():
        for t in parts:
            t.normal_()
    ring = ring_build(batch)
    ctas = default_ctas(torch.device("cuda"), ring)
    rts, ninstr = {}, {}
    for n in names:
        with swapped(_swaps(n)):
            prog = schedule(lower(cfg, w, cache, batch, ctas), ctas)
        ninstr[n] = len(prog.instrs)
        rts[n] = _runtime(prog, batch, context, ring=ring)
    med, mins = interleaved(rts, rounds)
    del rts, cache
    torch.cuda.empty_cache()
    return {"preset": preset, "batch": batch, "context": context, "ctas": ctas, "ring": ring, "rounds": rounds,
            "instructions": ninstr, "median_us": med, "min_us": mins}


def main(argv=None) -> int:
    ap = ab_parser("qwen3-30b-a3b", "1,2,4,8", 15, ",".join(VARIANTS), "mega-lower-ab.json", builds=False)
    args = ap.parse_args(argv)
    names = ab_variants(ap, args, VARIANTS)
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    for ring in sorted({ring_build(int(b)) for b in f"{args.batch},{args.check_batch}".split(",")}):
        compiled_launcher(dev, ring)  # each build the batches run: the runtimes' own (compiled, or the disk cache's)
    out = {"gpu": torch.cuda.get_device_name(), "git_sha": os.environ.get("MEGADECODE_GIT_SHA"),
           "compile_s": round(time.perf_counter() - t0, 1), "checks": [], "runs": []}
    for n in names:
        for p in CHECK_PRESETS:
            for b in map(int, args.check_batch.split(",")):
                with swapped(_swaps(n)):
                    r = diff_program(p, b, 16, seed=b)
                worst = max((x.get("rel", 0.0) for x in r.get("buffers", [])), default=None)
                out["checks"].append({"variant": n, "preset": p, "batch": b, "failures": diff_failures(r),
                                      "worst_rel": worst})
                print(f"check {n} {p} b={b}: {diff_failures(r) or 'pass'} (worst rel {worst})", flush=True)
    for p in args.preset.split(","):
        cfg = preset_config(p)
        w = random_weights(cfg, "cuda", torch.bfloat16, 0)
        w = expert_layout.take(w, build_plan(cfg), frag_order(cfg, "cuda"))  # as the mega executor holds them
        for b in map(int, args.batch.split(",")):
            r = timed(p, cfg, w, b, args.context, names, args.rounds)
            out["runs"].append(r)
            print(f"{p} b={b}: " + "  ".join(f"{n} {v:.0f} us ({r['instructions'][n]} instr)"
                                              for n, v in r["median_us"].items()), flush=True)
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
    ok = all(not c["failures"] for c in out["checks"])
    print(f"wrote {args.out}; every variant {'passes' if ok else 'does NOT pass'} its check")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
