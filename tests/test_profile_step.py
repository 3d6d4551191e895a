"""bench/profile_step.py's kernel time per plan op kind (`op_kind_times`): every op of the plan is attributed to a
range named after its kind, once, with the weight bytes it reads (routed experts: the selected ones). On the CPU
the ranges' CPU time stands in for the GPU's kernel time."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from megadecode.engine import Engine  # noqa: E402
from megadecode.presets import preset_config  # noqa: E402
from megadecode.step import Step  # noqa: E402
from megadecode.weights import random_weights  # noqa: E402


def test_op_kind_times_counts_every_op_once():
    from profile_step import op_kind_times

    cfg = preset_config("tiny-k3")
    e = Engine(cfg, random_weights(cfg, "cpu", torch.float32, 0), executor="torch", max_batch=2, max_seq_len=16)
    e.prefill([[1, 2, 3], [4, 5]])
    slots = torch.arange(2)
    step = Step(tokens=torch.tensor([3, 4]), positions=torch.tensor([3, 2]), slots=slots, logit_rows=slots,
                kv_len=4, contiguous_slots=True)
    got = op_kind_times(e.executor, step, "cpu")
    want = collections.Counter(op.kind for op in e.executor.plan.ops)
    assert {k: n for k, (n, _, _) in got.items()} == dict(want)
    assert all(t > 0 for _, t, _ in got.values())
    assert {"attn_kda", "attn_mla", "latent_moe", "lm_head"} <= set(got)
    w = e.executor.weights
    assert got["lm_head"][2] == w["lm_head.weight"].numel() * 4  # fp32
    # the routed experts: only the selected ones (2 tokens x top_k at most, a layer)
    moe = [op for op in e.executor.plan.ops if op.kind == "latent_moe"]
    stacks = sum(w[n].numel() for op in moe for n in op.weights if ".experts." in n)
    others = sum(w[n].numel() * w[n].element_size() for op in moe for n in op.weights if ".experts." not in n)
    picked = min(2 * cfg.top_k, cfg.num_experts)
    assert others < got["latent_moe"][2] <= others + stacks * picked // cfg.num_experts


def test_split_by_markers_attributes_kernels_between_markers_in_start_order():
    from profile_step import split_by_markers

    ks = [("b", 5.0, 1.0), ("spin_kernel", 0.0, 0.1), ("a", 2.0, 1.0), ("spin_kernel", 4.0, 0.1),
          ("spin_kernel", 9.0, 0.1), ("c", 7.0, 2.0), ("spin_kernel", 3.5, 0.1)]
    assert split_by_markers(ks) == [[], [("a", 2.0, 1.0)], [], [("b", 5.0, 1.0), ("c", 7.0, 2.0)], []]
