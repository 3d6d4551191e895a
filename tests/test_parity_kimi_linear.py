"""kimi_linear (hybrid KDA + NoPE MLA + DeepSeek-style MoE) against transformers' KimiLinearForCausalLM
(pinned 5.17.0): CPU, fp32, the tiny preset, random weights written as an HF checkpoint and loaded by both
sides. Our side runs a ragged batch; the oracle runs each prompt alone. transformers prefills KDA with its
chunked form and decodes with the recurrent one; ours runs the recurrence token by token in both."""

from __future__ import annotations

import pytest
import torch

from megadecode import Engine, SamplingParams
from megadecode.checkpoint import make_checkpoint
from megadecode.presets import preset_config

transformers = pytest.importorskip("transformers")

from hf_oracle import PROMPTS, hf_greedy, hf_teacher_forced, load_oracle, rel_err  # noqa: E402

NAME = "tiny-kimi-linear"
DECODE_STEPS = 20
GREEDY_STEPS = 32
RTOL = 1e-4



@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp(NAME), NAME, seed=3, dtype=torch.float32)


@pytest.fixture(scope="module")
def hf(ckpt):
    return load_oracle(ckpt)


def test_preset_mixes_layer_kinds():
    """The test model exercises every path: KDA and MLA layers, a dense layer, grouped MoE with shared experts."""
    cfg = preset_config(NAME)
    assert any(cfg.kda_layers) and not all(cfg.kda_layers)
    assert not cfg.moe_layers[0] and any(cfg.moe_layers)
    assert cfg.n_group > 1 and cfg.n_shared_experts >= 1 and not cfg.mla_rope


def test_oracle_builds_the_same_model(hf, ckpt):
    from megadecode.checkpoint import load_weights

    cfg, w = load_weights(ckpt)
    c = hf.config
    assert type(hf).__name__ == "KimiLinearForCausalLM"
    assert tuple(t == "linear_attention" for t in c.layer_types) == cfg.kda_layers
    assert tuple(t == "sparse" for t in c.mlp_layer_types) == cfg.moe_layers
    assert (c.num_local_experts, c.num_experts_per_tok, c.n_group, c.topk_group) == (
        cfg.num_experts, cfg.top_k, cfg.n_group, cfg.topk_group)
    assert (c.linear_num_heads, c.linear_head_dim, c.linear_conv_kernel_dim) == (
        cfg.linear_num_heads, cfg.linear_head_dim, cfg.conv_kernel)
    sd = hf.state_dict()
    assert set(sd) == set(w)  # every tensor both sides hold, under the same names
    for name, t in w.items():
        assert torch.equal(sd[name], t), name
    bias = [t for n, t in w.items() if n.endswith("e_score_correction_bias")]
    assert bias and all(b.abs().min() > 0 for b in bias)  # the selection bias takes part


# A fixed, non-greedy continuation, so both sides see identical inputs at every step.
CONT = torch.randint(0, 256, (DECODE_STEPS, len(PROMPTS)), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def hf_logits(hf):
    """[B, steps + 1, V]: the oracle's logits after each prompt and each continuation token (computed once)."""
    return [torch.stack(hf_teacher_forced(hf, p, CONT[:, b].tolist())) for b, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("executor", ["torch", "graph"])
def test_prefill_and_decode_logits_match_transformers(hf_logits, ckpt, executor):
    eng = Engine.from_pretrained(str(ckpt), executor=executor, max_batch=len(PROMPTS), max_seq_len=64)
    logits = [eng.prefill(PROMPTS, DECODE_STEPS)]
    for s in range(DECODE_STEPS):
        logits.append(eng.decode(CONT[s]))
    ours = torch.stack(logits, 1)  # [B, steps + 1, V]
    for b in range(len(PROMPTS)):
        ref = hf_logits[b]
        err = rel_err(ours[b], ref)
        assert err <= RTOL, f"{executor} prompt {b}: max relative logit error {err:.2e} > {RTOL}"
        assert torch.isfinite(ours[b]).all()


def test_greedy_tokens_match_transformers(hf, ckpt):
    eng = Engine.from_pretrained(str(ckpt), max_batch=len(PROMPTS), max_seq_len=64)
    ours = eng.generate(PROMPTS, GREEDY_STEPS, SamplingParams(greedy=True), stop_at_eos=False).token_ids
    for b, prompt in enumerate(PROMPTS):
        ref = hf_greedy(hf, prompt, GREEDY_STEPS)
        assert ours[b] == ref, f"prompt {b}: greedy tokens differ\n ours {ours[b]}\n hf   {ref}"
    distinct = {t for row in ours for t in row}
    assert len(distinct) >= 8, f"degenerate continuations {ours}: the test would not discriminate"


def test_graph_executor_agrees_with_torch(ckpt):
    engines = {x: Engine.from_pretrained(str(ckpt), executor=x, max_batch=len(PROMPTS), max_seq_len=64)
               for x in ("torch", "graph")}
    gen = torch.Generator().manual_seed(1)
    cont = torch.randint(0, 256, (8, len(PROMPTS)), generator=gen)
    out = {}
    for x, eng in engines.items():
        out[x] = [eng.prefill(PROMPTS, 8)] + [eng.decode(cont[s]) for s in range(8)]
    for s, (a, b) in enumerate(zip(out["torch"], out["graph"])):
        assert rel_err(b, a) <= 1e-5, f"step {s}"


def kda_state(eng: Engine, slots: int) -> list[torch.Tensor]:
    return [t[:slots].clone() for n in sorted(eng.cache.state_layers) for t in eng.cache[n]]


@pytest.mark.parametrize("executor", ["torch", "graph"])
def test_new_batch_does_not_inherit_stale_kda_state(ckpt, executor):
    """A slot reused by a new sequence starts from zero conv/recurrent state: the same requests give the same
    logits on an engine that ran another batch in those slots before as on a fresh engine."""
    used = Engine.from_pretrained(str(ckpt), executor=executor, max_batch=4, max_seq_len=64)
    used.prefill([[256] + list(range(60, 90)), [256, 3, 4, 5, 6, 7, 8], [256, 9], [256, 200, 201]], 10)
    for t in range(10):
        used.decode(torch.full((4,), 100 + t))
    assert any(s.abs().sum() > 0 for s in kda_state(used, 4))
    fresh = Engine.from_pretrained(str(ckpt), executor=executor, max_batch=4, max_seq_len=64)
    batch = [[256, 72, 101], [256, 7, 8, 9, 10]]  # fewer sequences than before: slots 2, 3 keep old state
    a, b = used.prefill(batch, 6), fresh.prefill(batch, 6)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    for x, y in zip(kda_state(used, 2), kda_state(fresh, 2)):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    for t in range(6):
        tok = torch.tensor([30 + t, 40 + t])
        torch.testing.assert_close(used.decode(tok), fresh.decode(tok), rtol=0, atol=0)


def test_prefill_then_decode_equals_longer_prefill(ckpt):
    """The conv window and the recurrent state handed from prefill to decode are the whole history:
    prefilling p[:-k] and decoding the last k tokens gives the logits of prefilling p."""
    eng = Engine.from_pretrained(str(ckpt), max_batch=1, max_seq_len=64)
    p = PROMPTS[2]
    full = eng.prefill([p])
    eng.prefill([p[:-5]], 5)
    for t in p[-5:]:
        last = eng.decode(torch.tensor([t]))
    assert rel_err(last, full) <= 1e-5
