"""The `megadecode` command line (cli.py) and the benchmark's byte accounting (bench.py)."""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megadecode import bench
from megadecode.cli import build_parser, main
from megadecode.backends import EXECUTORS
from megadecode.presets import preset_config

GEN = ["generate", "--model", "tiny-qwen3-moe", "--greedy", "--json", "--max-new-tokens", "5"]


def strict_json(text: str):
    """json.loads that refuses NaN / Infinity, which are not JSON (the standard library reads them by default)."""
    def refuse(token):
        raise AssertionError(f"not JSON: {token}")
    return json.loads(text, parse_constant=refuse)


def run_json(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0
    out = capsys.readouterr().out
    return strict_json(out)  # stdout holds exactly one JSON object


def fails(capsys, argv: list[str]) -> str:
    """The one-line error of a command the user got wrong (exit code 2, nothing on stdout, no traceback)."""
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("megadecode: error: ") and err.count("\n") == 1, err
    return err


def subcommands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


def test_help_lists_subcommands():
    out = subprocess.run([sys.executable, "-m", "megadecode", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert set(subcommands()) == {"generate", "serve", "make-checkpoint", "bench", "validate", "tune"}
    for cmd in subcommands():
        assert cmd in out


@pytest.mark.parametrize("argv", [["--help"], [], ["generate", "--help"], ["serve", "--help"],
                                  ["make-checkpoint", "--help"], ["generate", "--no-such-flag"]])
def test_help_and_argument_errors_import_no_torch(argv):
    """Building the parsers imports neither torch nor an executor (`--help` answers at once): what a command needs
    is imported when it runs. bench, validate and tune import theirs when named."""
    code = ("import sys; from megadecode.cli import main; rc = main(sys.argv[1:]); "
            "heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith('megadecode.backends')); "
            "print('IMPORTED', heavy, rc, file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True)
    assert "IMPORTED [] " in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().endswith(" 0" if "--help" in argv else " 2"), r.stderr[-500:]


def test_a_named_heavy_command_gets_its_flags_and_the_others_their_help_line():
    sub = next(a for a in build_parser(["bench", "--help"])._actions if isinstance(a, argparse._SubParsersAction))
    assert "--preset" in sub.choices["bench"].format_help()
    assert "--kernel" not in sub.choices["tune"].format_help()  # listed, not built
    helps = {a.dest: a.help for a in sub._choices_actions}
    full = {a.dest: a.help for a in next(a for a in build_parser()._actions
                                         if isinstance(a, argparse._SubParsersAction))._choices_actions}
    assert helps == full  # `megadecode --help` reads the same lines either way


def test_every_flag_has_help_and_its_default():
    for name, parser in subcommands().items():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"{name} {action.option_strings or action.dest}: no help"
            if action.option_strings:
                shown = formatter._get_help_string(action) % vars(action)
                assert "default" in shown or "(required)" in shown, f"{name} {action.option_strings}: {shown!r}"


def test_readme_command_line_section_lists_every_subcommand():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("## Command line", 1)[1].split("\n## ", 1)[0]
    for cmd in subcommands():
        assert f"### {cmd}" in section, cmd
        assert cmd in section.split("###", 1)[0], f"{cmd} missing from the README's `megadecode --help` line"
    for flag in ("--ignore-unknown-tensors", "--overwrite", "--check-finite"):
        assert flag in section
    listed = re.search(r"--executor (\w+(?:\|\w+)+)", section).group(1).split("|")  # the choices, a|b|c
    assert sorted(listed) == sorted(["auto", *EXECUTORS])


def test_generate_json_token_ids_deterministic(capsys):
    argv = GEN + ["--token-ids", "256,1,2", "--token-ids", "256,7"]
    a = run_json(capsys, argv)
    assert set(a) == {"model", "executor", "device", "dtype", "ep", "token_ids", "logprobs", "text", "warmup_s",
                      "prefill_s", "decode_s", "decode_tokens_per_s"}
    assert a["ep"] == 1
    assert len(a["token_ids"]) == len(a["logprobs"]) == len(a["text"]) == 2
    V = preset_config("tiny-qwen3-moe").vocab_size
    for ids, lps in zip(a["token_ids"], a["logprobs"]):
        assert len(ids) == len(lps)
        assert 1 <= len(ids) <= 5  # cut after EOS, if one came up
        assert len(ids) == 5 or ids[-1] == 257
        assert all(0 <= t < V for t in ids)
        assert all(lp <= 0 and math.isfinite(lp) for lp in lps)
    b = run_json(capsys, argv)
    assert b["token_ids"] == a["token_ids"] and b["logprobs"] == a["logprobs"]


def test_generate_text_output(capsys):
    assert main(["generate", "--max-new-tokens", "3", "--prompt", "hi", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("[0] 'hi' -> ") and "tokens/s" in out


def test_generate_bad_token_id(capsys):
    assert main(GEN + ["--token-ids", "256,99999"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megadecode: error:") and "99999" in err and "Traceback" not in err


def test_generate_unknown_model(capsys, tmp_path):
    assert main(GEN + ["--model", str(tmp_path / "no-such-model")]) == 2
    err = capsys.readouterr().err
    assert "megadecode: error:" in err and "no-such-model" in err


def test_generate_top_k_and_min_p(capsys):
    """--top-k 1 (or --min-p 1) at a high temperature draws the greedy tokens; --top-k 5 is Engine.generate's."""
    from megadecode.engine import Engine
    from megadecode.sampling import SamplingParams

    argv = ["generate", "--json", "--token-ids", "256,1,2", "--max-new-tokens", "8", "--temperature", "2"]
    greedy = run_json(capsys, argv + ["--greedy"])["token_ids"]
    assert run_json(capsys, argv)["token_ids"] != greedy
    assert run_json(capsys, argv + ["--top-k", "1"])["token_ids"] == greedy
    assert run_json(capsys, argv + ["--min-p", "1"])["token_ids"] == greedy
    engine = Engine.from_pretrained("tiny-qwen3-moe", max_batch=1, max_seq_len=16)
    want = engine.generate([[256, 1, 2]], 8, SamplingParams(temperature=2.0, top_k=5), seed=0).token_ids
    assert run_json(capsys, argv + ["--top-k", "5"])["token_ids"] == want


def test_bad_sampling_is_user_error(capsys):
    assert main(["generate", "--temperature", "-1", "--max-new-tokens", "2"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_temperature_zero_is_greedy_as_in_the_server(capsys):
    argv = ["generate", "--json", "--token-ids", "256,1,2", "--max-new-tokens", "6"]
    greedy = run_json(capsys, argv + ["--greedy"])
    zero = run_json(capsys, argv + ["--temperature", "0"])
    assert zero["token_ids"] == greedy["token_ids"] and zero["logprobs"] == greedy["logprobs"]


def test_make_checkpoint_then_generate(capsys, tmp_path):
    ckpt = tmp_path / "ckpt"
    assert main(["make-checkpoint", "--preset", "tiny-deepseek-v3", "--out", str(ckpt)]) == 0
    capsys.readouterr()
    assert (ckpt / "config.json").is_file()
    r = run_json(capsys, ["generate", "--model", str(ckpt), "--json", "--max-new-tokens", "3", "--check-finite"])
    assert r["model"] == str(ckpt)
    V = preset_config("tiny-deepseek-v3").vocab_size
    assert all(0 <= t < V for t in r["token_ids"][0]) and all(lp <= 0 for lp in r["logprobs"][0])


def test_make_checkpoint_unknown_preset(capsys, tmp_path):
    assert main(["make-checkpoint", "--preset", "no-such-preset", "--out", str(tmp_path / "x")]) == 2
    assert "no-such-preset" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_bench_needs_cuda():
    p = subprocess.run([sys.executable, "-m", "megadecode", "bench", "--preset", "tiny-qwen3-moe"],
                       capture_output=True, text=True)
    assert p.returncode == 2
    assert "megadecode: error:" in p.stderr and "CUDA" in p.stderr and "Traceback" not in p.stderr


def test_step_bytes_by_hand():
    cfg = preset_config("tiny-qwen3-moe")  # D 64, 3 layers (layer 1 dense), GQA 4 q / 2 kv heads of 16
    D, V, I, Idense, E, hd = 64, 259, 32, 96, 8, 16
    attn = 4 * hd * D + 2 * (2 * hd * D) + D * 4 * hd + 2 * hd  # q, k, v, o, q/k norms
    norms = 2 * D
    trunk = (3 * (attn + norms) + 3 * D * Idense + 2 * E * D + D) * 2  # + dense MLP, routers, final norm
    expert, lm_head = 3 * D * I * 2, V * D * 2
    cache_per_token = 3 * 2 * 2 * hd * 2  # layers x (k, v) x kv heads x head_dim x bf16
    got = bench.step_bytes(cfg, [5, 7], batch=4, context=100, cache_bytes_per_token=cache_per_token,
                           dtype_bytes=2)
    assert got == trunk + 12 * expert + lm_head + 4 * 100 * cache_per_token
    # recurrent (KDA) state is read once per sequence per step
    with_state = bench.step_bytes(cfg, [5, 7], batch=4, context=100, cache_bytes_per_token=cache_per_token,
                                  dtype_bytes=2, state_bytes_per_sequence=1000)
    assert with_state == got + 4 * 1000


def test_kimi_linear_cache_reports_its_state_bytes():
    from megadecode.cache import KVCache

    cfg = preset_config("tiny-kimi-linear")
    cache = KVCache(cfg, num_slots=2, max_len=16, device="cpu", dtype=torch.float32)
    per_seq = sum(t[0].numel() * t.element_size() for n in cache.state_layers for t in cache[n])
    assert per_seq > 0 and cache.state_bytes_per_sequence() == per_seq


def test_bench_helpers():
    assert str(bench.default_out("qwen3-30b-a3b", "NVIDIA H200")) == "bench/results/qwen3-30b-a3b-nvidia-h200.json"
    rows = [{"preset": "p", "executor": "torch", "batch": 1, "context": 8, "ms_per_step": 1.0,
             "tokens_per_s": 1000.0, "bytes_per_step": 2e9, "floor_ms": 0.5, "mbu": 0.5},
            {"preset": "p", "executor": "graph", "batch": 64, "context": 8, "error": "OutOfMemoryError: x"}]
    table = bench.format_table(rows)
    assert "50.0%" in table and "OutOfMemoryError" in table


def test_distinct_experts_counts_moe_layers():
    from megadecode.engine import Engine
    from megadecode.weights import random_weights

    cfg = preset_config("tiny-qwen3-moe")
    eng = Engine(cfg, random_weights(cfg), max_batch=4, max_seq_len=16)
    eng.lengths = [3] * 4
    counts = bench.distinct_experts(eng, torch.tensor([1, 2, 3, 4]))
    assert len(counts) == sum(cfg.moe_layers)
    assert all(cfg.top_k <= c <= min(cfg.num_experts, 4 * cfg.top_k) for c in counts)
    assert eng.lengths == [3] * 4  # the counting step does not advance the sequences


# ---- careless input: one line naming what the user gave, exit code 2 -----------------------------------------

def poison(ckpt: Path, name: str, index: tuple, value: float) -> None:
    wm = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    f = ckpt / wm[name]
    tensors = load_file(str(f))
    tensors[name][index] = value
    save_file(tensors, str(f), metadata={"format": "pt"})


@pytest.mark.parametrize("name, index, value", [
    ("model.layers.1.mlp.down_proj.weight", (3, 5), math.nan),  # a NaN anywhere in the trunk
    ("lm_head.weight", (40, 7), math.inf),  # an inf in one lm_head row: that token's logit
    ("lm_head.weight", (40, 7), -math.inf),
])
def test_non_finite_weights_end_generate_with_an_error(capsys, tiny_ckpt, name, index, value):
    """Without --check-finite such a checkpoint used to generate token 0 (or the poisoned token) with NaN
    logprobs, exit 0, and print a bare NaN with --json."""
    ckpt = tiny_ckpt("tiny-qwen3-moe")
    poison(ckpt, name, index, value)
    err = fails(capsys, ["generate", "--model", str(ckpt), "--greedy", "--json", "--max-new-tokens", "4"])
    assert f"{ckpt}: sequence 0: the logits for generated token 0 (the prefill" in err
    assert "NaN or inf" in err and "--check-finite" in err
    err = fails(capsys, ["generate", "--model", str(ckpt), "--max-new-tokens", "4", "--check-finite"])
    assert repr(name) in err


def test_json_output_is_strict(capsys, monkeypatch):
    """Whatever reaches the JSON writer, stdout never holds NaN (json.dumps writes it by default)."""
    from megadecode.engine import Engine, GenerationResult

    monkeypatch.setattr(Engine, "generate", lambda self, prompts, *a, **k: GenerationResult([[1]], [[math.nan]]))
    assert main(GEN) == 2
    out, err = capsys.readouterr()
    assert "NaN" not in out and err.startswith("megadecode: error: tiny-qwen3-moe: the result holds NaN or inf")


def test_make_checkpoint_onto_a_file_or_another_model(capsys, tmp_path):
    f = tmp_path / "a-file"
    f.write_text("x")
    err = fails(capsys, ["make-checkpoint", "--preset", "tiny-qwen3-moe", "--out", str(f)])
    assert str(f) in err and "not a directory" in err
    ckpt = tmp_path / "ckpt"
    assert main(["make-checkpoint", "--preset", "tiny-deepseek-v3", "--out", str(ckpt)]) == 0
    capsys.readouterr()
    config = (ckpt / "config.json").read_text()
    err = fails(capsys, ["make-checkpoint", "--preset", "tiny-qwen3-moe", "--out", str(ckpt)])
    assert f"{ckpt} is not empty" in err and "--overwrite" in err
    assert (ckpt / "config.json").read_text() == config
    assert main(["make-checkpoint", "--preset", "tiny-qwen3-moe", "--out", str(ckpt), "--overwrite"]) == 0
    assert '"qwen3_moe"' in (ckpt / "config.json").read_text()


def test_unknown_checkpoint_tensors(capsys, tiny_ckpt):
    ckpt = tiny_ckpt("tiny-qwen3-moe")
    wm_file = ckpt / "model.safetensors.index.json"
    index = json.loads(wm_file.read_text())
    save_file({"model.layers.0.mlp.extra_proj.weight": torch.zeros(2, 2)}, str(ckpt / "extra.safetensors"))
    index["weight_map"]["model.layers.0.mlp.extra_proj.weight"] = "extra.safetensors"
    wm_file.write_text(json.dumps(index))
    argv = ["generate", "--model", str(ckpt), "--json", "--max-new-tokens", "2"]
    err = fails(capsys, argv)
    assert "'model.layers.0.mlp.extra_proj.weight'" in err and "--ignore-unknown-tensors" in err
    assert main(argv + ["--ignore-unknown-tensors"]) == 0
    out, err = capsys.readouterr()
    assert strict_json(out)["token_ids"]
    assert err.startswith("megadecode: warning: ") and "'model.layers.0.mlp.extra_proj.weight'" in err


def test_model_larger_than_memory(capsys, monkeypatch):
    from megadecode import memory

    monkeypatch.setattr(memory, "available_bytes", lambda device: 1000)
    err = fails(capsys, GEN)
    assert re.search(r"tiny-qwen3-moe needs [0-9.]+ GB on cpu .* but only 0.00 GB is available", err), err


def test_prompt_longer_than_the_model_names_the_flag(capsys):
    err = fails(capsys, GEN[:-1] + ["32", "--prompt", "x" * 500])
    assert "prompt 0 has 501 tokens; with --max-new-tokens 32 it needs 533 positions" in err
    assert "max_position_embeddings" in err and "512" in err and "max_seq_len" not in err


@pytest.mark.parametrize("argv, text", [
    (["--seed", str(2**70)], "argument --seed: must be an integer in [0, 4294967295]"),
    (["--seed", "-1"], "argument --seed"),
    (["--temperature", "-0.5"], "--temperature must be finite and >= 0 (0: argmax, as --greedy), got -0.5"),
    (["--temperature", "nan"], "--temperature must be finite"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    (["--top-k", "-1"], "--top-k must be >= 0"),
    (["--min-p", "2"], "--min-p must be in [0, 1], got 2.0"),
    (["--max-new-tokens", "-1"], "--max-new-tokens must be >= 0"),
    (["--dtype", "fp8"], "argument --dtype: invalid choice"),
])
def test_bad_flags_name_the_flag(capsys, argv, text):
    err = fails(capsys, ["generate", "--max-new-tokens", "2"] + argv)
    assert text in err


def test_config_errors_name_the_config_field(capsys, tiny_ckpt):
    ckpt = tiny_ckpt("tiny-qwen3-moe")
    d = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**d, "num_experts_per_tok": 0}))
    assert "config field 'num_experts_per_tok' must be a positive integer" in fails(capsys, ["generate", "--model",
                                                                                             str(ckpt)])


NO_TRITON = "import sys; sys.modules['triton'] = None; from megadecode.cli import main; sys.exit(main(sys.argv[1:]))"


@pytest.mark.parametrize("argv", [["validate", "--list"], ["validate", "triton-router", "--quick"],
                                  ["generate", "--executor", "fused", "--max-new-tokens", "2"]])
def test_commands_that_need_triton_say_so_without_it(argv):
    """A fresh virtualenv without triton (pip install -e . without the test extra)."""
    p = subprocess.run([sys.executable, "-c", NO_TRITON, *argv], capture_output=True, text=True)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith("megadecode: error: ") and "pip install triton==3.6.0" in p.stderr


def test_generate_penalties(capsys):
    """--frequency-penalty / --presence-penalty / --repetition-penalty reach the sampler (the greedy tokens change)
    and are checked with one line naming the flag."""
    base = ["generate", "--model", "tiny-qwen3-moe", "--greedy", "--json", "--max-new-tokens", "16",
            "--token-ids", "256,9,9"]
    plain = run_json(capsys, base)["token_ids"][0]
    pen = run_json(capsys, base + ["--frequency-penalty", "2", "--presence-penalty", "2",
                                   "--repetition-penalty", "1.5"])["token_ids"][0]
    assert pen != plain and len(set(pen)) >= len(set(plain))
    assert "--presence-penalty must be in [-2, 2]" in fails(capsys, base + ["--presence-penalty", "3"])
    assert "--repetition-penalty must be finite and > 0" in fails(capsys, base + ["--repetition-penalty", "0"])


def test_generate_min_tokens_and_ignore_eos(capsys):
    base = ["generate", "--model", "tiny-qwen3-moe", "--greedy", "--json", "--max-new-tokens", "6",
            "--token-ids", "256,9"]
    assert len(run_json(capsys, base + ["--ignore-eos", "--min-tokens", "6"])["token_ids"][0]) == 6
    assert "--min-tokens must be in [0, --max-new-tokens = 6]" in fails(capsys, base + ["--min-tokens", "7"])
