"""Expert parallelism in several processes (issue 17, item 3): 2 and 4 gloo ranks, one process each
(tests/ep_workers.py, started as torchrun starts ranks), whose greedy tokens must equal one process's on the tiny
presets; also a checkpoint one rank cannot load, serving in lockstep, a rank that dies, and `torchrun -m megadecode
generate`. The pieces in one process: tests/test_parallel.py."""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

from megadecode.engine import Engine
from megadecode.parallel import launch
from megadecode.presets import preset_config
from megadecode.sampling import SamplingParams
from megadecode.weights import param_specs

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import ep_workers  # noqa: E402

PRESETS = ep_workers.PRESETS


# ---- whole runs: 2 and 4 ranks against one process ----------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _one_process(preset: str, executor: str, new_tokens: int):
    engine = Engine.from_pretrained(preset, executor=executor, max_batch=len(ep_workers.PROMPTS), max_seq_len=32)
    return engine.generate(ep_workers.PROMPTS, new_tokens, SamplingParams(greedy=True), stop_at_eos=False)


def one_process(preset: str, executor: str = "torch", new_tokens: int = ep_workers.NEW_TOKENS) -> list[list[int]]:
    return _one_process(preset, executor, new_tokens).token_ids


def one_process_logprobs(preset: str) -> list[list[float]]:
    return _one_process(preset, "torch", ep_workers.NEW_TOKENS).logprobs


def _run_ranks(tmp_path: Path, world: int, *scenarios: str) -> tuple[int, list[dict]]:
    code = launch.spawn([str(tmp_path), *scenarios], world, cmd=[sys.executable, str(HERE / "ep_workers.py")],
                        grace_s=5)
    return code, [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def _check_tokens_and_shards(results: list[dict], world: int) -> None:
    """Every rank's greedy tokens are one process's; it holds its experts and its lm_head rows (ceil(V / world),
    the tiny presets' V = 259 splitting unevenly: zero rows pad the last rank's), nothing of the others'. Logprobs
    come from the gathered logits, so they match one process's to rounding."""
    for preset in PRESETS:
        cfg = preset_config(preset)
        per_rank = cfg.num_experts // world
        want = one_process(preset)
        want_lp = one_process_logprobs(preset)
        V, D = cfg.vocab_size, cfg.hidden_size
        rows = -(-V // world)
        for r, res in enumerate(results):
            got = res["tokens"][preset]
            assert got["tokens"] == want, (preset, r)
            assert all(abs(a - b) < 1e-4 for x, y in zip(got["logprobs"], want_lp) for a, b in zip(x, y)), (preset, r)
            assert all(shape[0] == per_rank for shape in got["stacked"].values()), (preset, r)
            assert got["lm_head"] == [rows, D], (preset, r)
            whole = sum(math.prod(s.shape) for s in param_specs(cfg).values())
            others = sum((cfg.num_experts - per_rank) * math.prod(s.shape[1:])
                         for s in param_specs(cfg).values() if s.stacked)
            # the other ranks' experts and lm_head rows are nowhere
            assert got["numel"] == whole - others - (V - rows) * D, (preset, r)


def test_two_ranks_match_one_process(tmp_path, tiny_ckpt):
    """tokens (torch, graph, fused executors; the fused one over fragment-ordered experts too), both combine
    modes, an agreed load failure, serving in lockstep and a rank that dies: one process group of 2 ranks."""
    broken = tiny_ckpt("tiny-qwen3-moe")
    ep_workers.strip_experts(broken, range(4, 8), layer=2)
    code, results = _run_ranks(tmp_path, 2, "tokens", "graph", "fused", "fused-frag", "modes", f"missing:{broken}",
                               "serve", "die")
    assert code == 3  # rank 1's exit in the last scenario
    _check_tokens_and_shards(results, 2)
    assert results[0]["graph"]["tiny-qwen3-moe"]["tokens"] == one_process("tiny-qwen3-moe")
    for preset in ("tiny-deepseek-v3", "tiny-k3"):
        assert results[0]["fused"][preset]["tokens"] == one_process(preset, new_tokens=ep_workers.FAST_TOKENS)
    frag = results[0]["fused-frag"]
    assert frag["tokens"] == one_process("tiny-k3-wide", new_tokens=ep_workers.FAST_TOKENS)
    assert frag["frag"] and all(len(s) == 4 for n, s in frag["stacked"].items() if n.endswith("_packed"))
    assert frag["chosen"] == ["cute-latent-moe (expert parallel)"]
    for res in results:
        assert all(v == {"modes_equal": True, "rank_order": True} for v in res["modes"].values())
        # rank 0 loaded its experts; rank 1 could not, and every rank stops with rank 1's message
        assert res["missing"]["error"].startswith("rank 1: checkpoint ") and "rank 1 of 2 holds experts 4..7" in \
            res["missing"]["error"]
    serve = [one_process_single(tuple(p), n) for p, n in zip(ep_workers.SERVE_PROMPTS, ep_workers.SERVE_TOKENS)]
    assert results[0]["serve"]["tokens"] == serve
    assert results[1]["serve"]["followed"] >= sum(ep_workers.SERVE_TOKENS) - len(serve)  # its decode steps, at least
    died = results[0]["die"]
    assert died["error"] is not None and died["seconds"] < 30
    assert died["report"].startswith("rank 0: another rank stopped")  # the command line's one line


@functools.lru_cache(maxsize=None)
def one_process_single(prompt: tuple, new_tokens: int) -> list[int]:
    engine = Engine.from_pretrained("tiny-qwen3-moe", max_batch=1, max_seq_len=32)
    return engine.generate([list(prompt)], new_tokens, SamplingParams(greedy=True), stop_at_eos=False).token_ids[0]


def test_four_ranks_match_one_process(tmp_path):
    code, results = _run_ranks(tmp_path, 4, "tokens")
    assert code == 0
    _check_tokens_and_shards(results, 4)


def test_generate_under_torchrun_matches_one_process():
    """The command line as a user runs it across nodes: torchrun starts the ranks, rank 0 prints the JSON."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ids = ",".join(map(str, ep_workers.PROMPTS[0]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--nnodes", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(launch.free_port()), "-m", "megadecode", "generate",
           "--model", "tiny-deepseek-v3", "--ep", "2", "--greedy", "--json", "--max-new-tokens", "5",
           "--token-ids", ids, "--dist-timeout", "60"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)  # rank 0's one JSON object, nothing else on stdout
    engine = Engine.from_pretrained("tiny-deepseek-v3", max_batch=1, max_seq_len=32)
    want = engine.generate([ep_workers.PROMPTS[0]], 5, SamplingParams(greedy=True)).token_ids
    assert doc["ep"] == 2 and doc["token_ids"] == want


def test_eight_ranks_match_one_process(tmp_path):
    """Issue 18, item 4 on the CPU: 8 gloo ranks (one or two experts each) give one process's greedy tokens."""
    code, results = _run_ranks(tmp_path, 8, "tokens")
    assert code == 0
    _check_tokens_and_shards(results, 8)
