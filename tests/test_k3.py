"""kimi_k3 (megadecode/k3.md): config, MXFP4 weight table and checkpoints, the torch executor's K3 ops, presets.
CPU, fp32, the tiny-k3 preset (5 layers: KDA/MLA mixed, dense layer 0, 16 MXFP4 experts, AttnRes blocks of 2)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from megadecode import Engine
from megadecode import plan as P
from megadecode.cache import KVCache
from megadecode.checkpoint import CheckpointError, load_weights, make_checkpoint
from megadecode.cli import main
from megadecode.config import ConfigError, config_from_hf
from megadecode.engine import RequestError
from megadecode.backends.torch.ops import OP_IMPLS, StepContext
from megadecode.presets import preset_config, preset_hf_config
from megadecode.reference.attention import mla_attention
from megadecode.reference.kda import kda_attention
from megadecode.reference.routing import route
from megadecode.step import Step
from megadecode.weights import param_specs, random_weights, weight_bytes

NAME = "tiny-k3"
CFG = preset_config(NAME)
PROMPTS = [[256, 72, 101, 108, 108, 111, 33], [256, 7], [256, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def weights():
    return random_weights(CFG, seed=1)


def engine(w, cfg=CFG, **kw):
    return Engine(cfg, w, max_batch=kw.pop("max_batch", 4), max_seq_len=kw.pop("max_seq_len", 32), **kw)


def test_preset_exercises_every_k3_piece():
    assert CFG.family == "kimi_k3" and CFG.is_mla and not CFG.mla_rope and CFG.mla_output_gate
    assert any(CFG.kda_layers) and not all(CFG.kda_layers)
    assert CFG.moe_layers == (False, True, True, True, True) and CFG.intermediate_size == 96
    assert CFG.num_layers // CFG.attn_res_block_size >= 2  # AttnRes across several blocks
    assert (CFG.expert_act, CFG.expert_quant) == ("situ", "mxfp4")
    assert (CFG.latent_size, CFG.shared_intermediate_size) == (32, 64)
    kinds = {op.kind for op in P.build_plan(CFG).ops}
    assert {P.ATTN_KDA, P.ATTN_MLA, P.ATTN_RES, P.LATENT_MOE, P.ROUTER, P.MLP} <= kinds and P.EXPERTS not in kinds


# ---- (a) KDA and gated MLA pieces against the kimi_linear path ----------------------------------------------
def _kimi_linear_twin():
    d = preset_hf_config("tiny-kimi-linear")
    d.update(q_lora_rank=CFG.q_lora_rank, rms_norm_eps=CFG.rms_norm_eps)
    kl = config_from_hf(d)
    assert kl.is_kda(0) and not kl.is_kda(2) and CFG.is_kda(0) and not CFG.is_kda(2)
    return kl


def _prefill_then_decode(cfg, run, layer):
    """One layer's attention over a 2-sequence prefill and then a decode step; returns both outputs."""
    g = torch.Generator().manual_seed(5)
    cache = KVCache(cfg, 2, 16, "cpu", torch.float32)[f"cache.{layer}"]
    x1, x2 = torch.randn(7, CFG.hidden_size, generator=g), torch.randn(2, CFG.hidden_size, generator=g)
    pre = Step(tokens=torch.zeros(7, dtype=torch.long), positions=torch.tensor([0, 1, 2, 3, 0, 1, 2]),
               slots=torch.tensor([0] * 4 + [1] * 3), logit_rows=torch.tensor([3, 6]), kv_len=4,
               segments=[(0, 4, 0), (4, 7, 1)])
    dec = Step(tokens=torch.zeros(2, dtype=torch.long), positions=torch.tensor([4, 3]), slots=torch.arange(2),
               logit_rows=torch.arange(2), kv_len=5, contiguous_slots=True)
    return torch.cat([run(x1, pre, cache), run(x2, dec, cache)])


def _k3_op(w, layer, kind):
    op = next(o for o in P.build_plan(CFG).ops if o.layer == layer and o.kind == kind)

    def run(x, step, cache):
        ctx = StepContext(CFG, w, {op.cache: cache}, step)
        ctx.buf["normed"] = x
        OP_IMPLS[op.kind](ctx, op)
        return ctx.buf["attn_out"]
    return run


def test_kda_layer_equals_the_kimi_linear_path(weights):
    kl, a = _kimi_linear_twin(), "model.layers.0.self_attn"
    got = _prefill_then_decode(CFG, _k3_op(weights, 0, P.ATTN_KDA), 0)
    want = _prefill_then_decode(kl, lambda x, s, c: kda_attention(kl, weights, a, x, s, *c), 0)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_gated_mla_is_the_kimi_linear_mla_times_the_gate(weights):
    kl, a = _kimi_linear_twin(), "model.layers.2.self_attn"
    H, V, D = CFG.num_heads, CFG.v_head_dim, CFG.hidden_size
    assert H * V == D  # lets the kimi_linear path return its pre-o_proj output through an identity o_proj

    def kimi_linear(w):
        return _prefill_then_decode(kl, lambda x, s, c: mla_attention(kl, w, a, x, s, None, *c), 2)

    # gate weight 0: sigmoid = 1/2 everywhere
    w0 = dict(weights, **{f"{a}.gate_proj.weight": torch.zeros(H * V, D)})
    torch.testing.assert_close(_prefill_then_decode(CFG, _k3_op(w0, 2, P.ATTN_MLA), 2), 0.5 * kimi_linear(w0),
                               rtol=1e-6, atol=1e-6)
    # random gate: o_proj(core * sigmoid(x W_gate^T)), core from kimi_linear with o_proj = I
    core = kimi_linear(dict(weights, **{f"{a}.o_proj.weight": torch.eye(D)}))
    g = torch.Generator().manual_seed(5)
    xs = torch.cat([torch.randn(7, D, generator=g), torch.randn(2, D, generator=g)])  # the inputs used above
    gate = torch.sigmoid(xs @ weights[f"{a}.gate_proj.weight"].T)
    want = (core * gate) @ weights[f"{a}.o_proj.weight"].T
    torch.testing.assert_close(_prefill_then_decode(CFG, _k3_op(weights, 2, P.ATTN_MLA), 2), want, **TOL)


# ---- (b) LatentMoE op against an einsum restatement with our own MXFP4 decoder -------------------------------
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def decode_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[..., K/2] uint8 (low nibble = even element) + [..., K/32] e8m0 -> [..., K] fp32."""
    lo, hi = (packed & 15).long(), (packed >> 4).long()
    codes = torch.stack((lo, hi), -1).reshape(*packed.shape[:-1], -1)
    vals = torch.tensor(E2M1)[codes]
    s = torch.pow(2.0, scale.double() - 127).float().repeat_interleave(32, -1)
    return vals * s


def test_latent_moe_op_equals_einsum_restatement(weights):
    m = "model.layers.3.mlp"
    x = torch.randn(6, CFG.hidden_size, generator=torch.Generator().manual_seed(2))
    ids, rw = route(CFG, x, weights[f"{m}.gate.weight"], weights[f"{m}.gate.e_score_correction_bias"])
    op = next(o for o in P.build_plan(CFG).ops if o.layer == 3 and o.kind == P.LATENT_MOE)
    n = torch.arange(6)
    ctx = StepContext(CFG, weights, None, Step(tokens=n, positions=n, slots=n, logit_rows=n, kv_len=6))
    ctx.buf.update(normed=x, topk_ids=ids, topk_weights=rw)
    OP_IMPLS[P.LATENT_MOE](ctx, op)

    gu = decode_mxfp4(weights[f"{m}.experts.gate_up_proj.weight_packed"],
                      weights[f"{m}.experts.gate_up_proj.weight_scale"])  # [E, 2I, R]
    dn = decode_mxfp4(weights[f"{m}.experts.down_proj.weight_packed"],
                      weights[f"{m}.experts.down_proj.weight_scale"])  # [E, R, I]
    # T tokens, A active, R latent, F = 2I, I intermediate, D hidden
    h = torch.einsum("td,rd->tr", x, weights[f"{m}.latent_down.weight"])
    gu_ta = torch.einsum("tafr,tr->taf", gu[ids], h)
    g, u = gu_ta.chunk(2, -1)
    act = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
    z = torch.einsum("ta,tar->tr", rw, torch.einsum("tari,tai->tar", dn[ids], act))
    z = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + CFG.rms_norm_eps) * weights[f"{m}.latent_norm.weight"]
    want = torch.einsum("tr,dr->td", z, weights[f"{m}.latent_up.weight"])
    torch.testing.assert_close(ctx.buf["moe_out"], want, rtol=1e-5, atol=1e-5)
    assert gu.abs().max() > 0 and torch.isfinite(gu).all()


# ---- (c) whole-model consistency --------------------------------------------------------------------------------
def test_prefill_equals_step_by_step_decode(weights):
    p = PROMPTS[2]
    stepper = engine(weights)
    got = [stepper.prefill([p[:1]])[0]]
    for t in p[1:]:
        got.append(stepper.decode(torch.tensor([t]))[0])
    fresh = engine(weights)
    want = [fresh.prefill([p[:k + 1]])[0] for k in range(len(p))]
    torch.testing.assert_close(torch.stack(got), torch.stack(want), **TOL)


def test_ragged_batch_row_equals_sequence_alone(weights):
    def run(prompts, steps=4):
        e = engine(weights)
        out = [e.prefill(prompts)]
        tok = out[-1].argmax(-1)
        for _ in range(steps):
            out.append(e.decode(tok))
            tok = out[-1].argmax(-1)
        return torch.stack(out, 1)  # [B, steps+1, V]

    batch = run(PROMPTS)
    for i, p in enumerate(PROMPTS):
        torch.testing.assert_close(batch[i], run([p])[0], **TOL)


# ---- (d) AttnRes is live; one block reduces it to the plain residual stream ------------------------------------
def _logits(cfg, w):
    return engine(w, cfg).prefill(PROMPTS)


def test_attn_res_queries_change_the_output(weights):
    base = _logits(CFG, weights)
    for q in ("model.layers.3.attn_res.query", "model.attn_res.query"):  # a layer's, the final norm's
        w = dict(weights, **{q: weights[q] + 1.0})
        assert (_logits(CFG, w) - base).abs().max() > 1e-3, q
    # layer 0 has one source (the embedding): its query cannot matter
    w = dict(weights, **{"model.layers.0.attn_res.query": weights["model.layers.0.attn_res.query"] + 1.0})
    torch.testing.assert_close(_logits(CFG, w), base, rtol=0, atol=0)


def test_one_block_is_the_plain_residual_stream(weights):
    one_block = dataclasses.replace(CFG, attn_res_block_size=CFG.num_layers)
    plain = dataclasses.replace(CFG, attn_res_block_size=0)
    assert P.ATTN_RES not in {op.kind for op in P.build_plan(plain).ops}
    got = _logits(one_block, weights)
    torch.testing.assert_close(got, _logits(plain, weights), rtol=1e-5, atol=1e-5)
    moved = {n: (t + 1.0 if n.endswith("attn_res.query") else t) for n, t in weights.items()}
    torch.testing.assert_close(_logits(one_block, moved), got, rtol=0, atol=0)  # a single source: queries inert


# ---- (e) CLI and checkpoints ----------------------------------------------------------------------------------
def test_cli_generate_json(capsys):
    argv = ["generate", "--model", NAME, "--greedy", "--json", "--max-new-tokens", "4", "--token-ids", "256,1,2"]
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert len(r["token_ids"][0]) >= 1 and all(0 <= t < CFG.vocab_size for t in r["token_ids"][0])


def test_cli_make_checkpoint_then_generate(capsys, tmp_path):
    assert main(["make-checkpoint", "--preset", NAME, "--out", str(tmp_path / "ck")]) == 0
    capsys.readouterr()
    argv = ["generate", "--model", str(tmp_path / "ck"), "--json", "--max-new-tokens", "3", "--check-finite"]
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert all(0 <= t < CFG.vocab_size for t in r["token_ids"][0]) and all(lp <= 0 for lp in r["logprobs"][0])


def test_output_specs_cover_the_k3_ops(weights):
    from megadecode.contract import output_specs

    e = engine(weights, max_batch=3, max_seq_len=8)
    step = Step(tokens=torch.tensor([5, 6, 7]), positions=torch.tensor([0, 1, 2]), slots=torch.arange(3),
                logit_rows=torch.tensor([0, 2]), kv_len=3)
    ctx = StepContext(CFG, weights, e.cache, step)
    for op in e.plan.ops:
        specs = output_specs(CFG, op, ctx.buf, weights)
        OP_IMPLS[op.kind](ctx, op)
        for n, (shape, dt) in specs.items():
            assert (tuple(ctx.buf[n].shape), ctx.buf[n].dtype) == (shape, dt), (op.name, n)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("k3"), NAME, seed=4, dtype=torch.float32)


def test_make_checkpoint_load_generate(ckpt):
    names = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.15.up_proj.weight_packed" in names
    assert "model.layers.1.mlp.experts.gate_up_proj.weight_packed" not in names  # per expert on disk
    scales = load_file(str(ckpt / names["model.layers.1.mlp.experts.0.gate_proj.weight_scale"]))
    assert scales["model.layers.1.mlp.experts.0.gate_proj.weight_scale"].dtype == torch.uint8
    cfg, w = load_weights(ckpt, check_finite=True)
    assert cfg == CFG and cfg.hf["quantization_config"]["format"] == "mxfp4-pack-quantized"
    want = random_weights(CFG, seed=4)  # make_checkpoint draws the same tensors in the same order
    assert set(w) == set(want) and all(torch.equal(w[n], want[n]) for n in want)
    r = Engine.from_pretrained(str(ckpt), max_batch=2).generate([[256, 5, 6], [256]], 5)
    assert len(r.token_ids) == 2 and all(len(t) >= 1 for t in r.token_ids)


def _rewrite(ckpt, dst, name, new):
    """Copy of the checkpoint with tensor `name` replaced (`new`) or dropped (None)."""
    dst.mkdir()
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    for f in {v for v in index["weight_map"].values()}:
        sd = load_file(str(ckpt / f))
        if name in sd:
            sd.pop(name) if new is None else sd.__setitem__(name, new)
        save_file(sd, str(dst / f))
    if new is None:
        del index["weight_map"][name]
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    (dst / "config.json").write_text((ckpt / "config.json").read_text())
    return dst


def test_missing_packed_tensor_and_wrong_dtypes(ckpt, tmp_path):
    n = "model.layers.2.mlp.experts.3.down_proj.weight_packed"
    with pytest.raises(CheckpointError, match="experts.3.down_proj.weight_packed"):
        load_weights(_rewrite(ckpt, tmp_path / "a", n, None))
    s = "model.layers.2.mlp.experts.3.gate_proj.weight_scale"
    with pytest.raises(CheckpointError, match=f"{s}.*float32.*uint8"):
        load_weights(_rewrite(ckpt, tmp_path / "b", s, torch.zeros(64, 1)))
    with pytest.raises(CheckpointError, match=f"{s}.*shape"):
        load_weights(_rewrite(ckpt, tmp_path / "c", s, torch.zeros(64, 2, dtype=torch.uint8)))
    with pytest.raises(CheckpointError, match="NaN scale byte 255"):
        load_weights(_rewrite(ckpt, tmp_path / "d", s, torch.full((64, 1), 255, dtype=torch.uint8)),
                     check_finite=True)


# ---- (f) MXFP4 experts stay packed; bytes counted packed ------------------------------------------------------
def test_experts_stay_packed_in_the_engine(weights):
    e = engine(weights)
    for name, spec in param_specs(CFG).items():
        t = e.executor.weights[name]
        assert (t.dtype == torch.uint8) == (spec.quant == "mxfp4"), name
    I, R = CFG.moe_intermediate_size, CFG.latent_size
    assert weight_bytes(CFG, 2)["expert"] == 3 * I * R * 17 // 32  # K/2 + K/32 bytes per row: 4.25 bits
    k3 = preset_config("k3-layer")
    assert weight_bytes(k3, 2)["expert"] == 17_547_264  # 17.55 MB per expert, as the SPEC says
    with pytest.raises(RequestError, match="experts.gate_up_proj.weight_packed.*uint8"):
        name = "model.layers.1.mlp.experts.gate_up_proj.weight_packed"
        engine(dict(weights, **{name: weights[name].float()}))


def test_k3_mini_fits_one_h200():
    cfg = preset_config("k3-mini")
    assert cfg.kda_layers == (True, True, True, False) and all(cfg.moe_layers) and cfg.num_experts == 896
    wb = weight_bytes(cfg, 2)
    assert wb["expert"] * 896 * 4 < wb["total"] < 80e9
    seqs, ctx = 8, 4096
    H, K = cfg.linear_num_heads, cfg.linear_head_dim
    kda_state = (3 * H * K * (cfg.conv_kernel - 1) * 2 + H * K * K * 4) * seqs  # conv (bf16) + fp32 state
    mla_cache = seqs * ctx * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
    total = wb["total"] + 3 * kda_state + mla_cache
    assert total < 130 * 2**30, total / 2**30


# ---- (g) config errors ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("change,msg", [
    ({"latent_size": None}, "missing the required field 'latent_size'"),
    ({"latent_size": 48}, "multiples of 32"),
    ({"moe_intermediate_size": 40}, "multiples of 32"),
    ({"moe_hidden_act": "gelu"}, "moe_hidden_act"),
    ({"attn_res_block_size": -1}, "attn_res_block_size"),
    ({"mla_output_gate": "yes"}, "mla_output_gate"),
    ({"quantization_config": {"quant_method": "fp8"}}, "mxfp4-pack-quantized"),
    ({"num_shared_experts": 0}, "num_shared_experts"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias=true is not supported for kimi_k3"),
    ({"layer_types": ["linear_attention"]}, "layer_types"),
])
def test_bad_config(change, msg):
    d = preset_hf_config(NAME)
    d.update(change)
    if change.get("latent_size", 0) is None:
        del d["latent_size"]
    with pytest.raises(ConfigError, match=msg):
        config_from_hf(d)


def test_config_defaults_are_k3():
    d = {k: v for k, v in preset_hf_config("k3-mini").items()
         if k in ("model_type", "vocab_size", "hidden_size", "num_attention_heads", "num_experts",
                  "num_experts_per_tok", "moe_intermediate_size", "latent_size")}
    cfg = config_from_hf({**d, "num_hidden_layers": 93})
    assert sum(cfg.kda_layers) == 69 and cfg.num_layers - sum(cfg.kda_layers) == 24
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.linear_num_heads) == (1536, 512, 64, 96)
    assert (cfg.attn_res_block_size, cfg.intermediate_size, cfg.shared_intermediate_size) == (12, 33792, 6144)
    assert cfg.moe_layers == (False,) + (True,) * 92 and cfg.routed_scaling_factor == 1.0
    ok = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}
    assert config_from_hf({**d, "num_hidden_layers": 2, "quantization_config": ok}).expert_quant == "mxfp4"
    assert math.isclose(cfg.softmax_scale, 192 ** -0.5)
