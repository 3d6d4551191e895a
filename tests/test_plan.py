"""The decode plan: every weight is read, nothing unknown is read, buffers flow in order, and each
layer has the MLP kind its config says."""

from __future__ import annotations

from collections import Counter

import pytest

from megadecode import plan as P
from megadecode.config import config_from_hf
from megadecode.presets import PRESETS, preset_config, preset_hf_config
from megadecode.weights import param_specs


def variant(name: str, **changes):
    d = preset_hf_config(name)
    d.update(changes)
    return config_from_hf(d)


CONFIGS = {name: preset_config(name) for name in sorted(PRESETS)}
CONFIGS["qwen-sparse-step-2"] = variant("tiny-qwen3-moe", num_hidden_layers=4, decoder_sparse_step=2,
                                        mlp_only_layers=[])
CONFIGS["qwen-tied"] = variant("tiny-qwen3-moe", tie_word_embeddings=True)
CONFIGS["deepseek-no-q-lora-no-shared"] = variant("tiny-deepseek-v3", q_lora_rank=None, n_shared_experts=0,
                                                  first_k_dense_replace=2)
CONFIGS["deepseek-all-moe"] = variant("tiny-deepseek-v3", first_k_dense_replace=0)


@pytest.fixture(params=sorted(CONFIGS))
def cfg(request):
    return CONFIGS[request.param]


def test_every_weight_read_and_nothing_else(cfg):
    plan = P.build_plan(cfg)
    specs = param_specs(cfg)
    assert plan.config is cfg
    assert plan.weight_names() == set(specs)
    reads = Counter(w for op in plan.ops for w in op.weights)
    for name in specs:
        shared = cfg.tie_word_embeddings and name == "model.embed_tokens.weight"
        assert reads[name] == (2 if shared else 1), name  # each weight read by exactly one op
    if cfg.tie_word_embeddings:
        assert "lm_head.weight" not in specs
        assert plan.ops[-1].weights == ("model.embed_tokens.weight",)


def test_op_kinds(cfg):
    plan = P.build_plan(cfg)
    assert {op.kind for op in plan.ops} <= set(P.OP_KINDS)
    assert plan.ops[0].kind == P.EMBED and plan.ops[0].inputs == ("tokens",)
    assert [op.kind for op in plan.ops[-2:]] == [P.RMSNORM, P.LM_HEAD]
    assert plan.ops[-1].outputs == ("logits",)
    attn = P.ATTN_MLA if cfg.is_mla else P.ATTN_GQA
    only_kda = bool(cfg.kda_layers) and all(cfg.kda_layers)  # k3-layer: one KDA layer
    assert {op.kind for op in plan.ops} & {P.ATTN_GQA, P.ATTN_MLA} == (set() if only_kda else {attn})
    assert all(op.layer == -1 for op in plan.ops if op.kind in (P.EMBED, P.LM_HEAD))
    # the final norm's AttnRes (kimi_k3) is a model-level op
    assert all(0 <= op.layer < cfg.num_layers for op in plan.ops[1:-2] if op.kind != P.ATTN_RES)


def test_written_buffers(cfg):
    plan = P.build_plan(cfg)
    written = plan.written_buffers()
    caches = {f"cache.{i}" for i in range(cfg.num_layers)}
    assert caches <= written
    assert {"hidden", "normed", "attn_out", "final", "logits"} <= written
    assert written <= set(P.ACTIVATIONS) | caches
    assert not written & set(param_specs(cfg))  # weights are never written
    assert not written & set(P.INPUTS)  # step inputs are written by the host only
    moe = any(cfg.moe_layers)
    assert ({"topk_ids", "topk_weights", "moe_out"} <= written) == moe
    assert ("mlp_out" in written) == (not all(cfg.moe_layers))
    assert ("shared_out" in written) == (moe and cfg.n_shared_experts > 0)


def test_buffers_are_written_before_they_are_read(cfg):
    available = set(P.INPUTS)
    for op in P.build_plan(cfg).ops:
        assert set(op.inputs) <= available, op.name
        available |= set(op.outputs)


def test_each_layer_attention_reads_its_own_cache(cfg):
    plan = P.build_plan(cfg)
    attn = [op for op in plan.ops if op.kind in (P.ATTN_GQA, P.ATTN_MLA, P.ATTN_KDA)]
    assert [op.layer for op in attn] == list(range(cfg.num_layers))
    for op in attn:
        assert (op.kind == P.ATTN_KDA) == cfg.is_kda(op.layer)
        assert op.cache == f"cache.{op.layer}"
        assert op.cache in op.reads() and op.cache in op.writes()
        assert op.weights and all(w.startswith(f"model.layers.{op.layer}.self_attn.") for w in op.weights)
    assert sum(op.cache is not None for op in plan.ops) == cfg.num_layers


def test_moe_and_dense_layers_follow_the_config(cfg):
    plan = P.build_plan(cfg)
    for i, is_moe in enumerate(cfg.moe_layers):
        ops = [op for op in plan.ops if op.layer == i]
        kinds = Counter(op.kind for op in ops)
        p = f"model.layers.{i}.mlp"
        assert kinds[P.RMSNORM] == 2
        if is_moe and cfg.latent_size:  # kimi_k3: router, LatentMoE (MXFP4 experts), shared experts
            assert kinds[P.ROUTER] == 1 and kinds[P.LATENT_MOE] == 1 and kinds[P.EXPERTS] == 0, f"layer {i}"
            (lat,) = [op for op in ops if op.kind == P.LATENT_MOE]
            assert lat.inputs == ("normed", "topk_ids", "topk_weights") and lat.outputs == ("moe_out",)
            assert lat.weights == (f"{p}.latent_down.weight",
                                   *(f"{p}.experts.{n}.weight_{s}" for n in ("gate_up_proj", "down_proj")
                                     for s in ("packed", "scale")),
                                   f"{p}.latent_norm.weight", f"{p}.latent_up.weight")
        elif is_moe:
            assert kinds[P.ROUTER] == 1 and kinds[P.EXPERTS] == 1, f"layer {i}"
            experts = next(op for op in ops if op.kind == P.EXPERTS)
            assert set(experts.inputs) == {"normed", "topk_ids", "topk_weights"}
            if cfg.expert_quant == "fp8":  # each FP8 stack's values, then its block scales
                assert experts.weights == (f"{p}.experts.gate_up_proj", f"{p}.experts.gate_up_proj_scale_inv",
                                           f"{p}.experts.down_proj", f"{p}.experts.down_proj_scale_inv")
            else:
                assert experts.weights == (f"{p}.experts.gate_up_proj", f"{p}.experts.down_proj")
        if is_moe:
            router = next(op for op in ops if op.kind == P.ROUTER)
            assert router.outputs == ("topk_ids", "topk_weights")
            bias = f"{p}.gate.e_score_correction_bias"
            if cfg.score_func == "sigmoid":
                assert router.weights == (f"{p}.gate.weight", bias)  # the correction bias reaches the router
            else:
                assert router.weights == (f"{p}.gate.weight",)
            mlps = [op for op in ops if op.kind == P.MLP]
            if cfg.n_shared_experts:
                assert len(mlps) == 1 and all(w.startswith(f"{p}.shared_experts.") for w in mlps[0].weights)
                assert len(mlps[0].weights) == 3
            else:
                assert not mlps
        else:
            assert kinds[P.ROUTER] == 0 and kinds[P.EXPERTS] == 0, f"layer {i}"
            (mlp,) = [op for op in ops if op.kind == P.MLP]
            assert mlp.weights == tuple(f"{p}.{n}_proj.weight" for n in ("gate", "up", "down"))
            assert mlp.outputs == ("mlp_out",)
        # The layer ends by adding its MLP/MoE output into the residual stream.
        assert ops[-1].kind == P.ADD and ops[-1].outputs == ("hidden",)
        assert ops[-1].inputs == ("hidden", "moe_out" if is_moe else "mlp_out")


def test_variant_layouts():
    assert CONFIGS["qwen-sparse-step-2"].moe_layers == (False, True, False, True)
    assert CONFIGS["deepseek-no-q-lora-no-shared"].moe_layers == (False, False, True)
    assert CONFIGS["deepseek-all-moe"].moe_layers == (True, True, True)
    w = P.build_plan(CONFIGS["deepseek-no-q-lora-no-shared"]).weight_names()
    assert "model.layers.0.self_attn.q_proj.weight" in w and "model.layers.0.self_attn.q_a_proj.weight" not in w


def test_op_names():
    plan = P.build_plan(CONFIGS["tiny-deepseek-v3"])
    names = [op.name for op in plan.ops]
    assert "L1.router:topk_ids+topk_weights" in names and names[0] == "embed:hidden"
    assert names[-1] == "lm_head:logits"
