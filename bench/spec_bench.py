"""Speculative decoding's verify path at batch 1 (issue 43's goals): greedy generation of `--tokens` tokens, then
the same prompt with an oracle drafter (the recorded greedy continuation, so every draft is accepted: the verify
path's upper bound) at each k of `--k`. Per k: the verify steps, their mean time against a one-token decode step's
(the plain run's decode time over its steps), and tokens per second against the plain run's; then one verify step
of exactly k + 1 rows timed alone against a one-row step (`verify_steps`: the issue's verify-cost ratio, which the
runs' mean step understates when a drafter proposes fewer than k tokens). With `--draft-model M`,
the same again with M's drafts (speculative.DraftModelDrafter: acceptance and speed with a real drafter, its steps
counted in the time). In float32 the output must equal the plain run's (asserted). In bf16/fp16 a k+1-row step
sums in another order than a one-row step, so a greedy near-tie may flip, after which the plain run's continuation
is no longer the target's: each row records how many leading tokens agree with the plain run (`agree_tokens`), and
the oracle is re-recorded from the speculative run's own output until every draft is accepted (at most
`ORACLE_ROUNDS` runs, `oracle_rounds`; the last run's figures are reported). Writes `--out` JSON with the command.

    python bench/spec_bench.py --preset qwen3-30b-a3b --executor fused --device cuda --dtype bfloat16 \\
        --k 1,3,7 --tokens 128 --out $OUT/spec-qwen3-30b-a3b.json

On the CPU (tests): `--preset tiny-qwen3-moe --device cpu --dtype float32`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ORACLE_ROUNDS = 4
TIMED_STEPS = 20


def time_verify(eng, rows: int, pos: int, n: int = TIMED_STEPS) -> float:
    """Median seconds of a verify step of `rows` fed tokens of one sequence (slot 0, positions pos ..), the step
    alone (speculative.run_verify, then a device sync): its cost whatever a drafter's acceptance, where the
    generation runs' mean step mixes full steps with shorter ones (a drafter proposes fewer tokens where it has
    none). Writes cache entries at pos .. pos + rows - 1 of slot 0."""
    import statistics
    import time

    import torch

    from megadecode.speculative import run_verify

    sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)
    feed = [[3 + i for i in range(rows)]]
    times = []
    for _ in range(n + 2):  # the first two untimed
        sync()
        t0 = time.perf_counter()
        run_verify(eng, feed, [pos], [0])
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def run(preset: str, executor: str, device: str, dtype: str, ks: list[int], tokens: int, prompt_len: int = 16,
        seed: int = 0, draft_model: str | None = None) -> dict:
    import torch

    from megadecode.engine import Engine
    from megadecode.sampling import SamplingParams
    from megadecode.speculative import DraftModelDrafter, OracleDrafter, draft_model_drafter, generate

    eng = Engine.from_pretrained(preset, device=device, dtype=dtype, executor=executor, seed=seed, max_batch=1,
                                 max_seq_len=prompt_len + tokens + max(ks) + 8)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, min(eng.cfg.vocab_size, 250), (prompt_len,), generator=g).tolist()
    plain = eng.generate([prompt], tokens, SamplingParams(greedy=True), stop_at_eos=False)
    step_s = plain.decode_s / max(plain.decode_steps, 1)
    rows = []
    drafters = [("oracle", lambda k: OracleDrafter(k, [prompt + plain.token_ids[0]]))]
    if draft_model is not None:
        draft = draft_model_drafter(draft_model, max(ks), eng.cfg.vocab_size, device=device, dtype=dtype, seed=seed,
                                    max_batch=1, max_seq_len=eng.max_seq_len).engine
        drafters.append(("draft", lambda k: DraftModelDrafter(draft, k, eng.cfg.vocab_size)))
    for (kind, make), k in ((d, k) for d in drafters for k in ks):
        # the verify steps' decode graphs (1 .. k + 1 rows on one slot, speculative.run_verify) captured before the
        # timed run, as Engine.generate captures its own; the warm-up's writes at slot 0 go before the prefill
        eng.warmup(list(range(1, k + 2)), prompt_len + 1, prompt_len + tokens + k + 1, slot=0, causal_rows=True)
        res = generate(eng, [prompt], tokens, make(k), stop_at_eos=False)
        rounds = 1
        while kind == "oracle" and res.acceptance < 1.0 and rounds < ORACLE_ROUNDS:
            # the target's own continuation under verify steps, recorded from the last run
            res = generate(eng, [prompt], tokens, OracleDrafter(k, [prompt + res.token_ids[0]]), stop_at_eos=False)
            rounds += 1
        got, want = res.token_ids[0], plain.token_ids[0]
        agree = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        if dtype == "float32" and res.token_ids != plain.token_ids:
            raise AssertionError(f"{kind} k={k}: the speculative output differs from greedy generation "
                                 f"at token {agree} (float32)")
        verify_s = res.decode_s / max(res.steps, 1)
        rows.append({"drafter": kind, "k": k, "steps": res.steps, "acceptance": res.acceptance,
                     "agree_tokens": agree, "tokens": len(want), "oracle_rounds": rounds,
                     "tokens_per_step": res.tokens_per_step, "verify_step_ms": verify_s * 1e3,
                     "one_token_step_ms": step_s * 1e3, "verify_over_step": verify_s / step_s,
                     "tokens_per_s": res.decode_tokens_per_s, "plain_tokens_per_s": plain.decode_tokens_per_s,
                     "speedup": res.decode_tokens_per_s / plain.decode_tokens_per_s})
    # each verify step's cost at exactly k + 1 rows against one row's, timed alone (`time_verify`)
    pos = prompt_len + tokens // 2
    one = time_verify(eng, 1, pos)
    steps = [{"k": k, "rows": k + 1, "verify_ms": time_verify(eng, k + 1, pos) * 1e3, "one_row_ms": one * 1e3}
             for k in ks]
    for r in steps:
        r["verify_over_one_row"] = r["verify_ms"] / r["one_row_ms"]
    return {"preset": preset, "executor": executor, "device": device, "dtype": dtype, "tokens": tokens,
            "verify_steps": steps,
            "prompt_len": prompt_len, "draft_model": draft_model, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--executor", default="fused")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--k", default="1,3,7", help="draft tokens a step, comma-separated")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--draft-model", default=None, help="also time this draft model's drafts (same vocabulary)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch

    res = run(args.preset, args.executor, args.device, args.dtype, [int(k) for k in args.k.split(",")], args.tokens,
              draft_model=args.draft_model)
    res["gpu"] = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    res["git_sha"] = os.environ.get("MEGADECODE_GIT_SHA")
    res["command"] = "python bench/spec_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"{'drafter':>7} {'k':>3} {'steps':>6} {'accept':>7} {'tok/step':>9} {'verify ms':>10} {'step ms':>8} "
          f"{'ratio':>6} {'tok/s':>8} {'speedup':>8} {'agree':>7}")
    for r in res["rows"]:
        print(f"{r['drafter']:>7} {r['k']:>3} {r['steps']:>6} {r['acceptance']:>7.2f} {r['tokens_per_step']:>9.2f} "
              f"{r['verify_step_ms']:>10.3f} {r['one_token_step_ms']:>8.3f} {r['verify_over_step']:>6.2f} "
              f"{r['tokens_per_s']:>8.1f} {r['speedup']:>8.2f} {r['agree_tokens']:>3}/{r['tokens']:<3}")
    print(f"{'k':>3} {'rows':>5} {'verify ms':>10} {'1-row ms':>9} {'ratio':>6}   (one verify step timed alone)")
    for r in res["verify_steps"]:
        print(f"{r['k']:>3} {r['rows']:>5} {r['verify_ms']:>10.3f} {r['one_row_ms']:>9.3f} "
              f"{r['verify_over_one_row']:>6.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
