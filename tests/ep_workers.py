"""One rank of the expert-parallel tests (tests/test_ep.py), started as torchrun starts ranks: one process per
rank with torchrun's variables set (megadecode.parallel.launch.spawn), gloo on the CPU.

    python tests/ep_workers.py OUT_DIR SCENARIO [SCENARIO ...]

Each rank runs the scenarios in order in one process group (connecting costs seconds on a 2-core machine) and
writes what it saw to OUT_DIR/rank<r>.json; the test compares rank 0's tokens with one process's and checks what
every rank holds. Scenarios:
  tokens         greedy generate on tiny-qwen3-moe, tiny-deepseek-v3 and tiny-k3 (torch executor)
  graph          tiny-qwen3-moe through the graph executor (sync-free experts: torch._grouped_mm)
  fused          tiny-deepseek-v3 and tiny-k3 through the fused executor (the Triton variants over the local experts,
                 under the interpreter: FAST_TOKENS only, it is slow)
  fused-frag     tiny-k3-wide through the fused executor, its experts in fragment order (backends/expert_layout.py),
                 the CuTe kernel replaced by a torch stand-in (tests/frag_emulation.py)
  modes          the two combine modes on random partials: equal bit for bit, and to the rank-order sum
  missing:DIR    a checkpoint whose rank-1 experts are missing: every rank must fail, agreeing on the message
  serve          the server's lockstep: rank 0 serves requests (joining and leaving), the others replay its steps
  die            rank 1 exits with code 3; rank 0's next step must fail, not wait
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    # the ranks run on the CPU (gloo) even where there is a GPU: the fused scenario's Triton kernels must be decorated
    # for the interpreter, before megadecode.backends.fused.kernels is first imported (tests/conftest.py does this only without one)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

torch.set_num_threads(1)

from megadecode.engine import Engine  # noqa: E402
from megadecode.parallel import group  # noqa: E402
from megadecode.parallel.combine import ExpertParallel, scatter_combine, gather_combine, sum_in_rank_order  # noqa: E402
from megadecode.parallel.experts import ExpertShard  # noqa: E402
from megadecode.presets import preset_config  # noqa: E402
from megadecode.sampling import SamplingParams  # noqa: E402
from megadecode.weights import param_specs  # noqa: E402

PROMPTS = [[256, 72, 101, 108, 108, 111], [256, 7, 9]]
NEW_TOKENS = 5
FAST_TOKENS = 3  # the fused executor's steps under the Triton interpreter take ~0.5 s each on tiny-k3
PRESETS = ("tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-k3")
SERVE_PROMPTS = [[256, 72, 105], [256, 1, 2, 3, 4], [256, 33], [256, 9, 9]]
SERVE_TOKENS = [6, 3, 5, 4]


def parallel(ep, cfg, mode=None) -> ExpertParallel:
    return ExpertParallel(ExpertShard(cfg.num_experts, ep.world, ep.rank), ep.group, mode=mode)


def generate(ep, preset: str, executor: str = "torch", new_tokens: int = NEW_TOKENS) -> dict:
    cfg = preset_config(preset)
    engine = group.agree(ep, Engine.from_pretrained, preset, executor=executor, max_batch=len(PROMPTS),
                         max_seq_len=32, parallel=parallel(ep, cfg))
    res = engine.generate(PROMPTS, new_tokens, SamplingParams(greedy=True), stop_at_eos=False)
    specs = param_specs(cfg)
    stacked = {n: list(t.shape) for n, t in engine.executor.weights.items() if specs[n].stacked}
    return {"tokens": res.token_ids, "logprobs": res.logprobs, "stacked": stacked,
            "lm_head": list(engine.executor.weights["lm_head.weight"].shape),
            "numel": sum(t.numel() for t in engine.executor.weights.values()),
            "frag": getattr(engine.executor, "frag_experts", False),
            "chosen": sorted({v for (k, _), v in getattr(engine.executor, "chosen", {}).items() if k == "latent_moe"})}


def fused_frag(ep) -> dict:
    """tiny-k3-wide through the fused executor with its routed experts in fragment order (this rank's experts,
    re-laid out), the CuTe kernel replaced by tests/frag_emulation.py's torch stand-in."""
    from frag_emulation import patch_cute

    undo = patch_cute()
    try:
        res = generate(ep, "tiny-k3-wide", "fused", FAST_TOKENS)
    finally:
        undo()
    return res


def modes(ep) -> dict:
    out = {}
    for T in (1, 3, 5):
        def partial(r):
            return torch.randn(T, 12, generator=torch.Generator().manual_seed(1000 * T + r))

        x = partial(ep.rank)
        a, b = gather_combine(x, ep.world, ep.group), scatter_combine(x, ep.world, ep.group)
        want = sum_in_rank_order(torch.stack([partial(r) for r in range(ep.world)]))
        out[T] = {"modes_equal": torch.equal(a, b), "rank_order": torch.equal(a, want)}
    return out


def missing(ep, ckpt: str) -> dict:
    cfg = preset_config("tiny-qwen3-moe")
    try:
        group.agree(ep, Engine.from_pretrained, ckpt, parallel=parallel(ep, cfg), max_batch=1, max_seq_len=16)
    except group.RankFailed as e:
        return {"error": str(e)}
    return {"error": None}


def serve(ep) -> dict:
    from megadecode.cli import build_parser
    from megadecode.sequence import Sequence
    from megadecode.serve import main as serve_main

    args = build_parser().parse_args(["serve", "--model", "tiny-qwen3-moe", "--ep", str(ep.world), "--max-batch", "2",
                                      "--max-seq-len", "32"])
    server = serve_main.build_server(args, ep)
    if ep.rank != 0:
        return {"followed": serve_main.follow(server, ep)}
    try:
        server.start()
        # four requests through two slots: they join and leave the running batch at different steps
        seqs = [Sequence(prompt=p, max_tokens=n, stop_ids=frozenset()) for p, n in zip(SERVE_PROMPTS, SERVE_TOKENS)]
        chans = [server.submit_sequence(s, aio=None) for s in seqs]
        tokens = []
        for chan in chans:
            got = []
            while True:
                d = chan.queue.get(timeout=60)
                if d.token is not None:
                    got.append(d.token)
                if d.finish_reason is not None:
                    assert d.finish_reason == "length", d
                    break
            tokens.append(got)
    finally:
        server.stop()
    return {"tokens": tokens}


def die(ep, out: Path, results: dict) -> dict:
    cfg = preset_config("tiny-qwen3-moe")
    engine = group.agree(ep, Engine.from_pretrained, "tiny-qwen3-moe", max_batch=1, max_seq_len=16,
                         parallel=parallel(ep, cfg))
    if ep.rank == 1:
        write(out, ep.rank, results)
        os._exit(3)  # noqa: SLF001 - a rank that disappears without a word
    t = time.monotonic()
    try:
        engine.generate([[256, 1]], 8, SamplingParams(greedy=True))
    except Exception as e:  # noqa: BLE001 - what the survivor sees, and what the command line would print
        from megadecode import ranks

        ranks._joined = True
        return {"error": f"{type(e).__name__}: {e}"[:300], "report": ranks.peer_failure(e),
                "seconds": time.monotonic() - t}
    return {"error": None, "seconds": time.monotonic() - t}


def strip_experts(ckpt: Path, experts: range, layer: int) -> None:
    """Delete the checkpoint tensors of `experts` of one layer (hub layout, per expert), as a broken download would
    (a helper of the tests, not a scenario)."""
    import re

    from safetensors.torch import load_file, save_file

    pat = re.compile(rf"model\.layers\.{layer}\.mlp\.experts\.(\d+)\.")
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    for f in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(ckpt / f))
        keep = {n: t for n, t in tensors.items() if not ((m := pat.match(n)) and int(m.group(1)) in experts)}
        save_file(keep, str(ckpt / f), metadata={"format": "pt"})
    index["weight_map"] = {n: f for n, f in index["weight_map"].items()
                           if not ((m := pat.match(n)) and int(m.group(1)) in experts)}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))


def write(out: Path, rank: int, results: dict) -> None:
    (out / f"rank{rank}.json").write_text(json.dumps(results))


def main(argv: list[str]) -> int:
    out, scenarios = Path(argv[0]), argv[1:]
    ep = group.init(int(os.environ["WORLD_SIZE"]), "cpu", timeout_s=60)
    results: dict = {"world": ep.world}
    for name in scenarios:
        t = time.monotonic()
        if name == "tokens":
            results[name] = {p: generate(ep, p) for p in PRESETS}
        elif name == "graph":
            results[name] = {"tiny-qwen3-moe": generate(ep, "tiny-qwen3-moe", "graph")}
        elif name == "fused":
            results[name] = {p: generate(ep, p, "fused", FAST_TOKENS) for p in ("tiny-deepseek-v3", "tiny-k3")}
        elif name == "fused-frag":
            results[name] = fused_frag(ep)
        elif name == "modes":
            results[name] = modes(ep)
        elif name.startswith("missing:"):
            results["missing"] = missing(ep, name.split(":", 1)[1])
        elif name == "serve":
            results[name] = serve(ep)
        elif name == "die":
            results[name] = die(ep, out, results)
        else:
            raise SystemExit(f"unknown scenario {name!r}")
        results.setdefault("seconds", {})[name.split(":")[0]] = round(time.monotonic() - t, 2)
    write(out, ep.rank, results)
    if "die" not in scenarios:
        ep.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
