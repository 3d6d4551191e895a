"""The CuTe megakernel on the GPU (skipped without CUDA and nvidia-cutlass-dsl): every buffer and cache of one launch
against pyvm on the same program and inputs, repeats and the random-delay build bitwise identical; decode and greedy
generation through the `mega` executor against the `torch` executor on the same bf16 weights, routing near ties
excused only where the reference's own margins show one (validate/near_tie.py, e2e.py)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("cutlass", reason="the megakernel needs nvidia-cutlass-dsl")

from megadecode.validate.mega_gpu import (PATH_CASES, diff_failures, diff_program, e2e_failures, end_to_end,  # noqa: E402
                                         timeout_case, timeout_failures)

PRESETS = ["tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-k3"]



@pytest.mark.parametrize("batch", [1, 3, 16])
# + mega_gpu.CASES: MXFP4 rows of several chunks, qwen3-30b-a3b's GQA shape (head_dim 128, 16 q heads a KV head)
@pytest.mark.parametrize("preset", PRESETS + ["tiny-k3-wide", "tiny-k3-frag", "tiny-qwen3-gqa"])
def test_launch_matches_pyvm_and_repeats_bitwise(preset, batch):
    r = diff_program(preset, batch, ctas=16, seed=batch, delay_runs=1)
    assert not diff_failures(r), diff_failures(r)  # every buffer within mega_gpu.BUFFER_TOL, repeats bitwise equal
    assert all(x["equal"] for x in r["buffers"] if "equal" in x)


@pytest.mark.parametrize("preset, batch, context", PATH_CASES)
def test_launch_reaches_every_path_and_matches_pyvm(preset, batch, context):
    """mega_gpu.PATH_CASES: batch tails up to 64, experts of several passes, context 1, and the last position of a
    1000-position cache, where every attention split spans several 64-position chunks and ends on a partial one."""
    r = diff_program(preset, batch, ctas=16, seed=batch, delay_runs=1, context=context)
    assert not diff_failures(r), diff_failures(r)
    assert context != "max" or r["longest_split"] > 64


def test_a_wait_past_its_limit_raises_naming_the_instruction_and_the_counter():
    """A signal removed on the device: the launch returns (no hang) and MegaRuntime.check raises MegaError naming
    an instruction that waits on a blocked counter, and the counter."""
    r = timeout_case()
    assert not timeout_failures(r), (timeout_failures(r), r)


def test_the_checks_catch_the_planted_silent_timeout_and_skipped_chunk_on_the_gpu():
    """validate/mega_plants.py: a wait that proceeds silently raises nothing (timeout_failures names it); a split
    whose last partial chunk is skipped differs from pyvm at the long splits, though not at the old contexts."""
    from megadecode.validate.mega_plants import planted_launcher

    silent = planted_launcher("silent_timeout", "cuda", bodies=("EMBED",))
    assert timeout_failures(timeout_case(kernel=silent))
    skip = planted_launcher("skip_last_chunk", "cuda")
    assert diff_failures(diff_program("tiny-qwen3-moe", 5, ctas=16, seed=5, delay_runs=0, context="max", kernel=skip))
    assert not diff_failures(diff_program("tiny-qwen3-moe", 3, ctas=16, seed=3, delay_runs=0, kernel=skip))


@pytest.mark.parametrize("preset", PRESETS + ["tiny-k3-frag", "tiny-qwen3-gqa"])
def test_decode_matches_pyvm_and_is_close_to_torch(preset):
    """4 teacher-forced decode steps of 4 sequences: every row-step within 1e-3 of pyvm (the same math: fp32
    activations, bf16 caches); against the bf16 torch executor the median row-step within 3e-2, at most a quarter
    over it (routing near ties, validate/near_tie.py) and every clear token the same."""
    r = end_to_end(preset, 4, tokens=8, seed=3)
    vt = r["vs_torch_bf16"]
    assert not e2e_failures(r), (e2e_failures(r), r)  # mega_gpu.E2E_PYVM_TOL
    assert vt["median"] < 3e-2 and vt["frac_over"] <= 0.25 and vt["clear_token_mismatches"] == 0, r


def test_validate_command_passes_mega_against_pyvm(capsys):
    """`megadecode validate --executor mega` as a user runs it: the audit, then greedy lockstep against pyvm."""
    from megadecode.cli import main

    assert main(["validate", "--executor", "mega", "--preset", "tiny-k3", "--steps", "16"]) == 0
    assert "e2e tiny-k3 bfloat16 vs pyvm: PASS" in capsys.readouterr().out


_CACHED_RUN = """
import json, sys, torch
from megadecode.backends.mega.runtime import compiled_launcher
from megadecode.validate.mega_gpu import diff_failures, diff_program
launcher = compiled_launcher(torch.device("cuda"))
r = diff_program("tiny-qwen3-moe", 3, ctas=16, seed=5, delay_runs=1, kernel=launcher)
print(json.dumps({"source": launcher.source, "registers": launcher.registers, "failures": diff_failures(r)}))
"""


def test_the_kernel_cached_on_disk_loads_in_a_fresh_process_and_matches_pyvm(tmp_path):
    """The disk cache across processes (backends/mega/kernel_cache.py), as two users' processes meet it: the first
    compiles and stores, the second loads the exported object (no compile said) with the same register count;
    both launchers match pyvm on every buffer, repeats and delayed launches included."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "MEGADECODE_KERNEL_CACHE": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", _CACHED_RUN], env=env, capture_output=True, text=True,
                           timeout=600) for _ in range(2)]
    for p in runs:
        assert p.returncode == 0, p.stderr[-3000:]
    first, second = (json.loads(p.stdout.strip().splitlines()[-1]) for p in runs)
    assert first["source"] == "compiled" and "compiling the megakernel" in runs[0].stderr
    assert second["source"] == "cache" and "compiling" not in runs[1].stderr
    assert first["registers"] == second["registers"] is not None
    assert not first["failures"] and not second["failures"], (first, second)
    assert len(list(tmp_path.iterdir())) == 1  # one entry, no temporary directory left
