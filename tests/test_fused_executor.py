"""The `fused` executor (megadecode/backends/fused/executor.py) on the CPU under the Triton interpreter,
fp32: its decode steps run the registered Triton variants (scope permitting) and match the torch executor.
Same interpreter arrangement as tests/test_fused_experts.py."""

from __future__ import annotations

import pytest
import torch

from interp import (  # noqa: E402, F401 (interpreter_env: an autouse fixture, imported to apply here)
    DEVICE, greedy_run, import_interpreted, interpreter_env, triton_gate,
)

CATALOG = import_interpreted("megadecode.validate.catalog")

from megadecode import Engine  # noqa: E402
from megadecode.backends.fused.kernels import grouped_experts as GE  # noqa: E402
from megadecode.presets import preset_config  # noqa: E402
from megadecode.weights import random_weights  # noqa: E402

TRITON_OK, needs_triton = triton_gate(GE.grouped_up_kernel)



@needs_triton
@pytest.mark.parametrize("preset,batch", [("tiny-qwen3-moe", 3), ("tiny-deepseek-v3", 3),
                                          ("tiny-qwen3-moe", 18), ("tiny-k3", 2)])
def test_fused_decode_matches_torch(preset, batch):
    cfg = preset_config(preset)
    w = random_weights(cfg, DEVICE, torch.float32, seed=3)
    prompts = [[1 + i, 5, 9 + i % 4][: 1 + i % 3] for i in range(batch)]
    _, tok_t, log_t = greedy_run(cfg, w, "torch", prompts, 6)
    e, tok_f, log_f = greedy_run(cfg, w, "fused", prompts, 6)
    assert torch.equal(tok_f, tok_t)
    err = (log_f - log_t).abs().max().item()
    assert err <= 1e-4 * log_t.abs().max().item(), err
    chosen = {k: v for (k, b), v in e.executor.chosen.items() if b == batch}
    assert chosen["rmsnorm"] == "triton-rmsnorm", chosen
    assert chosen["add_rmsnorm"] == "triton-add-rmsnorm", chosen
    assert chosen["router"] == "triton-router", chosen
    if preset != "tiny-k3":
        assert chosen["experts"] == "triton-grouped-experts", chosen
    else:  # K3 has no EXPERTS op: its LATENT_MOE op is the Triton variant
        assert chosen["latent_moe"] == "triton-latent-moe", chosen
        assert chosen["attn_kda"] == "triton-kda-fused", chosen
    if preset != "tiny-qwen3-moe":
        assert chosen["attn_mla"] == "triton-mla-decode", chosen
    else:
        assert chosen["attn_gqa"] == "triton-gqa-decode", chosen


@needs_triton
def test_generate_samples_inside_the_step():
    """Engine.generate with the fused executor samples in the decode step (backends/fused/kernels/lm_head.py) for greedy and
    temperature sampling: greedy gives the torch executor's tokens; sampled tokens repeat for a seed, change
    with it, and their logprobs are log_softmax of the step's logits at the token. Top-p stays outside."""
    from megadecode.sampling import SamplingParams

    cfg = preset_config("tiny-qwen3-moe")
    w = random_weights(cfg, DEVICE, torch.float32, seed=4)
    prompts = [[1, 5, 9], [2, 7], [3]]
    ref = Engine(cfg, w, executor="torch", max_batch=3, max_seq_len=40)
    eng = Engine(cfg, w, executor="fused", max_batch=3, max_seq_len=40)
    greedy = SamplingParams(greedy=True)
    a = ref.generate(prompts, 5, greedy, stop_at_eos=False)
    b = eng.generate(prompts, 5, greedy, stop_at_eos=False)
    assert eng.executor.sampling == greedy and b.token_ids == a.token_ids
    for x, y in zip(a.logprobs, b.logprobs):
        assert torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-4)
    hot = SamplingParams(temperature=1.5)
    s1, s2 = (eng.generate(prompts, 6, hot, seed=s, stop_at_eos=False) for s in (1, 2))
    assert eng.executor.sampling == hot
    assert eng.generate(prompts, 6, hot, seed=1, stop_at_eos=False).token_ids == s1.token_ids
    assert s1.token_ids != s2.token_ids
    assert int(eng.executor.seed) == 1 * 1_000_003 + 4  # fresh noise per decode step (the last run: seed 1, k = 4)
    # the in-step logprob is log_softmax(logits)[token] of that step
    eng.executor.set_sampling(hot)
    eng.prefill(prompts)
    eng.executor.seed.fill_(7)
    logits = eng.decode(torch.tensor([1, 2, 3], device=DEVICE)).clone()
    tok, lp = eng.executor.sampled
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).gather(-1, tok[:, None])[:, 0], rtol=1e-5,
                               atol=1e-5)
    assert not eng.executor.set_sampling(SamplingParams(top_p=0.9)) and eng.executor.sampled is not None
    assert not eng.executor.set_sampling(hot, batch=65) and eng.executor.set_sampling(hot, batch=64)
    c = eng.generate(prompts, 3, SamplingParams(top_p=0.9), stop_at_eos=False)  # top-p: sampling.sample
    assert eng.executor.sampling is None and len(c.token_ids[0]) == 3


@needs_triton
def test_non_finite_logits_are_flagged_when_the_step_samples():
    """With sampling inside the step (lm_head_sample), the step's own logits are checked: a NaN in lm_head row 7
    makes every row's logits NaN from the prefill on (here the first sequence is named), and an inf in the
    embedding row of a token fed only by sequence 1's second decode step is found at that step."""
    from megadecode.engine import NonFiniteError
    from megadecode.sampling import SamplingParams

    cfg = preset_config("tiny-qwen3-moe")
    w = random_weights(cfg, DEVICE, torch.float32, seed=0)
    prompts = [[1, 2, 3], [4, 5]]
    eng = Engine(cfg, w, executor="fused", max_batch=2, max_seq_len=16)
    greedy = SamplingParams(greedy=True)
    clean = eng.generate(prompts, 4, greedy, stop_at_eos=False).token_ids
    assert eng.executor.sampling == greedy  # the decode steps sampled in the step
    t = clean[1][1]
    assert t not in prompts[0] + prompts[1] + clean[0] + clean[1][:1]
    w["model.embed_tokens.weight"][t, 3] = float("inf")
    with pytest.raises(NonFiniteError, match=r"^sequence 1: the logits for generated token 2 \(decode step 2 of 3"):
        eng.generate(prompts, 4, greedy, stop_at_eos=False)
    w["model.embed_tokens.weight"][t, 3] = 0.0
    w["lm_head.weight"][7, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"^sequence 0: the logits for generated token 0 \(the prefill.*1 more"):
        eng.generate(prompts, 4, SamplingParams(temperature=0.7), stop_at_eos=False)



@needs_triton
@pytest.mark.parametrize("preset", ["tiny-k3", "tiny-kimi-linear"])
def test_rmsnorm_and_router_variants_pass_on_kimi_families(preset):
    """triton-rmsnorm's scope includes the kimi families: the harness checks it on their RMSNorm op (K3's
    first one reads the AttnRes output `layer_in`)."""
    from megadecode.validate.checks import check_op
    from megadecode.validate.catalog import get

    for batch in (1, 7):
        row = check_op(get("triton-rmsnorm"), preset_config(preset), "rmsnorm", "float32", batch, seed=batch,
                       device=DEVICE)
        assert row["status"] == "PASS", row
        for dist in ("uniform", "hot_expert", "exact_ties"):
            row = check_op(get("triton-router"), preset_config(preset), "router", "float32", batch, seed=batch,
                           dist=dist, device=DEVICE)
            assert row["status"] == "PASS", row


def test_fuse_add_rmsnorm_rewrites_each_add_followed_by_its_norm():
    from megadecode import plan as P

    for preset in ("tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-k3"):
        plan = P.build_plan(preset_config(preset))
        fused = P.fuse_add_rmsnorm(plan)
        pairs = sum(1 for a, b in zip(plan.ops, plan.ops[1:]) if a.kind == P.ADD and b.kind == P.RMSNORM
                    and len(b.inputs) == 1 and b.inputs[0] == a.outputs[0])
        comp = [o for o in fused.ops if o.kind == P.ADD_RMSNORM]
        assert pairs > 0 and len(comp) == pairs and len(fused.ops) == len(plan.ops) - pairs
        assert all(len(o.inputs) == 2 and len(o.outputs) == 2 and len(o.weights) == 1 for o in comp)
        # the final norm (two inputs: it gathers the logit rows) is never fused
        assert fused.ops[-2].kind == P.RMSNORM and len(fused.ops[-2].inputs) == 2


@needs_triton
@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-k3"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_add_rmsnorm_variant_passes_check_op(preset, dtype):
    from megadecode.validate.checks import check_op
    from megadecode.validate.catalog import get

    for batch in (1, 7):
        row = check_op(get("triton-add-rmsnorm"), preset_config(preset), "add_rmsnorm", dtype, batch, seed=batch,
                       device=DEVICE)
        assert row["status"] == "PASS", row


@needs_triton
@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-deepseek-v3"])
def test_fused_decode_serves_every_length_with_one_graph(preset):
    """Both attention kernels read each sequence's position from device memory, so with them in scope a decode
    step runs at kv_len = the cache's length (one graph per batch size, issue 16); a batch past their scope falls
    back to the reference attention, which slices the cache on the host: one graph per length bucket."""
    cfg = preset_config(preset)
    e = Engine(cfg, random_weights(cfg, DEVICE, torch.float32, seed=3), executor="fused", max_batch=2, max_seq_len=40)
    assert e.executor.length_free(2)
    e.executor.use_graphs = True  # what graph_lengths answers on a GPU
    assert e.executor.graph_lengths(2, 1, 40) == [40]
    assert not e.executor.length_free(300)
