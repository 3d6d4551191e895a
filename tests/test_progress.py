"""Feedback on long work: the weights' build or load reported tensor by tensor in bytes (Engine.from_pretrained's
`progress`, the command line's bars), and when the bars are off (--quiet, --json, another rank, or stderr not a
terminal: tqdm's rule)."""

from __future__ import annotations

import argparse
import re

import pytest
import torch

from megadecode.args import bar_off, byte_feed
from megadecode.checkpoint import make_checkpoint
from megadecode.engine import Engine
from megadecode.weights import weight_bytes


def _calls(model, **kw):
    seen = []
    engine = Engine.from_pretrained(model, progress=lambda n, total: seen.append((n, total)), **kw)
    return engine, seen


@pytest.mark.parametrize("dtype, nbytes", [("float32", 4), ("bfloat16", 2)])
def test_a_preset_build_reports_every_tensor_up_to_the_weights_bytes(dtype, nbytes):
    engine, seen = _calls("tiny-deepseek-v3", dtype=dtype)
    total = weight_bytes(engine.cfg, nbytes)["total"]
    assert seen and all(t == total for _, t in seen) and all(n > 0 for n, _ in seen)
    assert sum(n for n, _ in seen) == total
    from megadecode.weights import param_specs

    assert len(seen) == len(param_specs(engine.cfg))  # one report a tensor


def test_a_checkpoint_load_reports_the_same_bytes(tmp_path):
    out = make_checkpoint(tmp_path / "ckpt", "tiny-qwen3-moe", seed=3, dtype=torch.bfloat16)
    engine, seen = _calls(str(out), dtype="bfloat16")
    assert sum(n for n, _ in seen) == seen[-1][1] == weight_bytes(engine.cfg, 2)["total"]


def test_byte_feed_sets_the_total_and_advances():
    class Bar:
        total, n = 0, 0

        def update(self, k):
            self.n += k

    bar = Bar()
    feed = byte_feed(bar)
    feed(10, 30)
    feed(20, 30)
    assert (bar.total, bar.n) == (30, 30)


def test_bars_are_off_with_quiet_json_or_another_rank_else_tqdms_terminal_rule():
    ns = argparse.Namespace
    assert bar_off(ns(quiet=True)) is True
    assert bar_off(ns(quiet=False), True) is True  # --json, or a rank that does not report
    assert bar_off(ns(quiet=False), False) is None  # tqdm: shown on a terminal, off otherwise
    assert bar_off(ns()) is None


def test_generate_takes_quiet_and_prints_no_bar_when_stderr_is_no_terminal(capsys):
    from megadecode.cli import main

    for extra in ([], ["--quiet"]):
        assert main(["generate", "--model", "tiny-qwen3-moe", "--greedy", "--max-new-tokens", "3", *extra]) == 0
        out, err = capsys.readouterr()
        assert "tokens/s" in out and "weights" not in err and "decode" not in err, err


def test_validate_counts_its_cells_on_a_bar(capsys, monkeypatch):
    """`validate`'s bar advances a cell at a time (shown where stderr is a terminal: forced here); --quiet: none."""
    from megadecode.cli import main
    from megadecode.validate import command

    argv = ["validate", "broken-rmsnorm-nc-load", "--quick", "--extra", "0", "--preset", "tiny-qwen3-moe"]
    monkeypatch.setattr(command, "bar_off", lambda args: True if args.quiet else False)
    main(argv)
    out, err = capsys.readouterr()
    total = re.search(r"total: (\d+) PASS, (\d+) FAIL, (\d+) SKIP", out)
    counts = re.findall(r"validate broken-rmsnorm-nc-load: (\d+)cell", err)
    assert total and counts and int(counts[-1]) == sum(map(int, total.groups())), (out, err)  # every cell
    main(argv + ["--quiet"])
    assert "validate broken-rmsnorm-nc-load" not in capsys.readouterr().err


def test_generate_reports_its_stages_compile_prefill_and_decode():
    """Engine.generate's three reports: the warm-up's graphs (total set first: none on the CPU, where nothing is
    captured), the prompts' tokens once the prefill is done, and each decode step."""
    class Bar:
        def __init__(self):
            self.n, self.total = 0, None

        def update(self, k):
            self.n += k

        def refresh(self):
            pass

    eng = Engine.from_pretrained("tiny-qwen3-moe", max_batch=2, max_seq_len=32)
    warm, pre, dec = Bar(), Bar(), Bar()
    eng.generate([[256, 7, 9], [256, 5]], 4, progress=dec, warmup_progress=warm, prefill_progress=pre,
                 stop_at_eos=False)
    assert (warm.total, warm.n, pre.n, dec.n) == (0, 0, 5, 3)
