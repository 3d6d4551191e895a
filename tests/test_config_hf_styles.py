"""config.json in the key styles real checkpoints use: as written by hand on the hub (the presets' style), as
transformers 5 writes it (`num_local_experts`, `rope_parameters`, Kimi-Linear's `num_experts_per_token`, ...),
with transformers' default special tokens, and with FP8 block-scaled quantization."""

from __future__ import annotations

import warnings

import pytest

from megadecode.config import ConfigError, ConfigWarning, config_from_hf
from megadecode.presets import preset_hf_config

transformers = pytest.importorskip("transformers")

QWEN, DS, KIMI = "tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-kimi-linear"
CLASSES = {QWEN: "Qwen3MoeConfig", DS: "DeepseekV3Config", KIMI: "KimiLinearConfig"}

# Keys as transformers 5.24.0 (the newest 5.x at the time) wrote them in save_pretrained's config.json for
# these presets (observed in a separate virtualenv; 5.17.0 writes the same ones): the fields our presets spell
# otherwise, and the rope fields folded into `rope_parameters`.
NEW_STYLE = {
    QWEN: {"rename": {"num_experts": "num_local_experts"},
           "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}},
    KIMI: {"rename": {"num_experts_per_tok": "num_experts_per_token", "n_group": "num_expert_group",
                      "n_shared_experts": "num_shared_experts", "norm_topk_prob": "moe_renormalize",
                      "max_position_embeddings": "model_max_length"}},
}


def quiet(fn, *a):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none of these configs warns
        return fn(*a)


@pytest.mark.parametrize("name", [QWEN, DS, KIMI])
def test_config_written_by_transformers_reads_as_the_preset(name):
    """What the installed transformers' config class writes for a preset (its own key names and rope format)
    is the same model."""
    d = preset_hf_config(name)
    written = getattr(transformers, CLASSES[name])(**{k: v for k, v in d.items() if k != "model_type"}).to_dict()
    assert written["model_type"] == d["model_type"]
    if "num_nextn_predict_layers" not in d:  # DeepseekV3Config writes its default, 1, with no MTP layer behind it
        written.pop("num_nextn_predict_layers", None)
    assert quiet(config_from_hf, written) == quiet(config_from_hf, d)


@pytest.mark.parametrize("name", [QWEN, KIMI])
def test_newest_transformers_key_style(name):
    """The issue's report: a Qwen3-MoE config.json with `num_local_experts` and `rope_parameters` (no
    `num_experts`, no `rope_theta`) was refused."""
    d = preset_hf_config(name)
    new = dict(d)
    for old, key in NEW_STYLE[name]["rename"].items():
        new[key] = new.pop(old)
    if "rope_parameters" in NEW_STYLE[name]:
        new.pop("rope_theta")
        new["rope_parameters"] = NEW_STYLE[name]["rope_parameters"]
    assert not set(NEW_STYLE[name]["rename"]) & set(new)
    cfg = quiet(config_from_hf, new)
    assert cfg == quiet(config_from_hf, d)
    assert cfg.num_experts == d.get("num_experts") and cfg.hf == new


def test_kimi_linear_hub_config_keys():
    """Kimi-Linear-48B-A3B's own config.json spells the MoE fields its way and carries fields only its modeling code
    reads; the released values are accepted, others refused."""
    d = preset_hf_config(KIMI)
    hub = {k: v for k, v in d.items() if k not in NEW_STYLE[KIMI]["rename"]}
    hub.update({new: d[old] for old, new in NEW_STYLE[KIMI]["rename"].items()})
    hub.update(moe_router_activation_func="sigmoid", moe_layer_freq=1, mla_use_nope=True, rope_scaling=None,
               auto_map={"AutoConfig": "configuration_kimi.KimiLinearConfig"})
    assert quiet(config_from_hf, hub) == quiet(config_from_hf, d)
    for key, bad in (("moe_router_activation_func", "softmax"), ("moe_layer_freq", 2), ("mla_use_nope", False)):
        with pytest.raises(ConfigError, match=f"config field '{key}' = {bad!r} is not supported"):
            config_from_hf({**hub, key: bad})


def test_deepseek_rope_parameters_style():
    d = preset_hf_config(DS)
    new = dict(d)
    scaling = dict(new.pop("rope_scaling"))
    new["rope_parameters"] = {"rope_theta": new.pop("rope_theta"), "rope_type": scaling.pop("type"), **scaling}
    assert config_from_hf(new) == config_from_hf(d)


def test_required_field_under_its_other_spelling():
    d = preset_hf_config(DS)
    d["num_local_experts"] = d.pop("n_routed_experts")  # DeepseekV3Config's alias
    assert config_from_hf(d).num_experts == 16


# ---- special-token ids outside the vocabulary: a warning, the ids ignored ---------------------------------

@pytest.mark.parametrize("name", [QWEN, DS, KIMI])
@pytest.mark.parametrize("changes, want_bos, want_eos, text", [
    ({"eos_token_id": 259}, 256, (), "eos_token_id 259"),
    ({"eos_token_id": [257, -1]}, 256, (257,), "eos_token_id -1"),
    ({"bos_token_id": 300}, None, (257,), "bos_token_id 300"),
])
def test_special_token_outside_the_vocabulary_is_a_warning(name, changes, want_bos, want_eos, text):
    d = {**preset_hf_config(name), **changes}
    with pytest.warns(ConfigWarning, match=f"{text} outside the vocabulary \\[0, 259\\)"):
        cfg = config_from_hf(d)
    assert cfg.bos_token_id == want_bos and cfg.eos_token_id == want_eos
    assert cfg.hf == d  # the file as written


def test_small_kimi_linear_with_transformers_default_special_tokens():
    """The issue's report: KimiLinearConfig's default ids (bos 163584, eos 163586) with a small vocabulary."""
    d = preset_hf_config(KIMI)
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        d.pop(k)
    written = transformers.KimiLinearConfig(**{k: v for k, v in d.items() if k != "model_type"}).to_dict()
    assert written["eos_token_id"] == 163586 and written["vocab_size"] == 259
    with pytest.warns(ConfigWarning) as w:
        cfg = config_from_hf(written)
    assert {str(x.message).split(" ")[1] for x in w} == {"bos_token_id", "eos_token_id"}
    assert cfg.eos_token_id == () and cfg.bos_token_id is None
    # also when the fields are left out: transformers' defaults are the ones in effect
    with pytest.warns(ConfigWarning) as w:
        assert config_from_hf(d).eos_token_id == ()
    assert any("eos_token_id 163586" in str(x.message) for x in w)


def test_cli_prints_the_warning_on_one_line(tmp_path, capsys):
    import json

    from megadecode.checkpoint import make_checkpoint
    from megadecode.cli import main

    ckpt = make_checkpoint(tmp_path / "c", QWEN)
    d = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**d, "eos_token_id": [257, 9999]}))
    assert main(["generate", "--model", str(ckpt), "--max-new-tokens", "2", "--json"]) == 0
    err = capsys.readouterr().err
    assert "megadecode: warning: config.json eos_token_id 9999 outside the vocabulary [0, 259): ignored for " \
           "stopping" in err


# ---- FP8 block-scaled quantization -------------------------------------------------------------------

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 64]}


@pytest.mark.parametrize("name", [QWEN, DS, KIMI])
def test_fp8_quantization_config(name):
    d = {**preset_hf_config(name), "quantization_config": FP8}
    cfg = config_from_hf(d)
    assert cfg.expert_quant == "fp8" and cfg.weight_block == (32, 64)
    plain = config_from_hf(preset_hf_config(name))
    assert plain.expert_quant is None and plain.weight_block is None
    # DeepSeek-V3's own form (no fmt / activation_scheme needed), Qwen3-FP8's modules_to_not_convert
    d["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [32, 32],
                                "modules_to_not_convert": ["lm_head"]}
    assert config_from_hf(d).weight_block == (32, 32)


def test_fp8_refused_for_k3():
    d = {**preset_hf_config("tiny-k3"), "quantization_config": FP8}
    with pytest.raises(ConfigError, match="compressed-tensors"):
        config_from_hf(d)
