"""HF safetensors checkpoints: sharded, single-file and pre-stacked layouts load into the weight table;
every defect (missing, mis-shaped, wrong dtype, bad index, non-finite on request) names the tensor."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from megadecode.checkpoint import CheckpointError, UnknownTensorsWarning, load_weights, make_checkpoint
from megadecode.config import ConfigError
from megadecode.engine import Engine
from megadecode.presets import preset_config, preset_hf_config
from megadecode.weights import param_specs, random_weights

DS, QWEN = "tiny-deepseek-v3", "tiny-qwen3-moe"
INDEX = "model.safetensors.index.json"
SMALL_SHARD = 200_000  # bytes: the fp32 tiny-deepseek-v3 (about 1.3 MB) spans several shards


def weight_map(ckpt: Path) -> dict[str, str]:
    return json.loads((ckpt / INDEX).read_text())["weight_map"]


def edit_shard(ckpt: Path, name: str, fn) -> None:
    """Rewrite the shard that holds `name`; fn(tensors) edits the shard's dict in place."""
    f = ckpt / weight_map(ckpt)[name]
    tensors = load_file(str(f))
    fn(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def set_tensor(ckpt: Path, name: str, value: torch.Tensor) -> None:
    def put(ts):
        ts[name] = value.contiguous()
    edit_shard(ckpt, name, put)


def read_all(ckpt: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def single_file_checkpoint(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return dst


# ---- loading ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", [DS, QWEN])
def test_load_gives_every_weight_with_its_shape(tiny_ckpt, preset):
    ckpt = tiny_ckpt(preset, shard_bytes=SMALL_SHARD)
    cfg, w = load_weights(ckpt)
    assert cfg == preset_config(preset)
    specs = param_specs(cfg)
    assert set(w) == set(specs)
    for name, spec in specs.items():
        assert tuple(w[name].shape) == spec.shape, name
        assert w[name].dtype == torch.float32, name
    # The writer draws the same numbers as random_weights: a preset and its checkpoint are one model.
    ref = random_weights(cfg, "cpu", torch.float32, seed=0)
    for name in specs:
        assert torch.equal(w[name], ref[name]), name


def test_stacked_experts_equal_the_per_expert_tensors(tiny_ckpt):
    ckpt = tiny_ckpt(DS, shard_bytes=SMALL_SHARD)
    cfg, w = load_weights(ckpt)
    wm = weight_map(ckpt)
    I = cfg.moe_intermediate_size

    def file_tensor(name):
        with safe_open(str(ckpt / wm[name]), "pt") as h:
            return h.get_tensor(name)

    checked = 0
    for i, moe in enumerate(cfg.moe_layers):
        p = f"model.layers.{i}.mlp.experts"
        if not moe:
            assert f"{p}.gate_up_proj" not in w and f"{p}.0.gate_proj.weight" not in wm
            continue
        gate_up, down = w[f"{p}.gate_up_proj"], w[f"{p}.down_proj"]
        for j in range(cfg.num_experts):
            assert torch.equal(gate_up[j, :I], file_tensor(f"{p}.{j}.gate_proj.weight"))  # gate rows first
            assert torch.equal(gate_up[j, I:], file_tensor(f"{p}.{j}.up_proj.weight"))
            assert torch.equal(down[j], file_tensor(f"{p}.{j}.down_proj.weight"))
            checked += 1
    assert checked == 2 * cfg.num_experts


def test_router_correction_bias_is_nonzero_and_fp32(tiny_ckpt):
    ckpt = tiny_ckpt(DS)
    cfg, w = load_weights(ckpt, dtype=torch.bfloat16)
    biases = [f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i, m in enumerate(cfg.moe_layers) if m]
    assert len(biases) == 2
    for b in biases:
        assert w[b].dtype == torch.float32  # kept fp32 whatever the model dtype
        assert w[b].shape == (cfg.num_experts,)
        assert (w[b] != 0).all() and w[b].std() > 0.01, b
        assert len(set(w[b].tolist())) == cfg.num_experts  # no ties: the bias changes the order
    assert w["model.layers.0.mlp.gate_proj.weight"].dtype == torch.bfloat16


def test_sharding_and_index(tiny_ckpt):
    ckpt = tiny_ckpt(DS, shard_bytes=SMALL_SHARD)
    files = sorted(p.name for p in ckpt.glob("*.safetensors"))
    n = len(files)
    assert n >= 4
    assert files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    index = json.loads((ckpt / INDEX).read_text())
    wm = index["weight_map"]
    assert set(wm.values()) == set(files)
    total = 0
    for f in files:
        ts = load_file(str(ckpt / f))
        assert {k for k, v in wm.items() if v == f} == set(ts)  # the index lists exactly each shard's tensors
        size = sum(t.numel() * t.element_size() for t in ts.values())
        # A shard only goes over the limit when it holds a single tensor larger than the limit.
        assert size <= SMALL_SHARD or len(ts) == 1, f
        total += size
    assert index["metadata"]["total_size"] == total
    # Per-expert HF names, no stacked names, in the files.
    assert "model.layers.1.mlp.experts.15.down_proj.weight" in wm
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in wm)
    assert json.loads((ckpt / "config.json").read_text())["torch_dtype"] == "float32"


def test_one_shard_by_default(tiny_ckpt):
    ckpt = tiny_ckpt(DS)
    assert [p.name for p in ckpt.glob("*.safetensors")] == ["model-00001-of-00001.safetensors"]


def test_single_file_checkpoint_without_index(tiny_ckpt, tmp_path):
    src = tiny_ckpt(DS, shard_bytes=SMALL_SHARD)
    dst = single_file_checkpoint(src, tmp_path / "single", read_all(src))
    assert not (dst / INDEX).exists()
    _, want = load_weights(src)
    _, got = load_weights(dst)
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_already_stacked_experts_load(tiny_ckpt, tmp_path):
    src = tiny_ckpt(DS)
    cfg, want = load_weights(src)
    # transformers-5 layout: the stacked tensors under their internal names, no per-expert tensors.
    dst = single_file_checkpoint(src, tmp_path / "stacked", want)
    with safe_open(str(dst / "model.safetensors"), "pt") as h:
        names = set(h.keys())
    assert "model.layers.1.mlp.experts.gate_up_proj" in names
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" not in names
    _, got = load_weights(dst)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_mixed_stacked_and_per_expert_layers(tiny_ckpt, tmp_path):
    src = tiny_ckpt(DS)
    _, want = load_weights(src)
    tensors = {k: v for k, v in read_all(src).items() if not k.startswith("model.layers.2.mlp.experts.")}
    tensors["model.layers.2.mlp.experts.gate_up_proj"] = want["model.layers.2.mlp.experts.gate_up_proj"]
    tensors["model.layers.2.mlp.experts.down_proj"] = want["model.layers.2.mlp.experts.down_proj"]
    _, got = load_weights(single_file_checkpoint(src, tmp_path / "mixed", tensors))
    for k in want:
        assert torch.equal(got[k], want[k]), k


def with_extra(src: Path, dst: Path, extra: dict[str, torch.Tensor], **config) -> Path:
    """A single-file copy of `src` with `extra` tensors added and `config` fields set in its config.json."""
    ckpt = single_file_checkpoint(src, dst, {**read_all(src), **extra})
    if config:
        d = json.loads((ckpt / "config.json").read_text())
        (ckpt / "config.json").write_text(json.dumps({**d, **config}))
    return ckpt


def test_expected_extra_tensors_are_skipped(tiny_ckpt, tmp_path):
    """DeepSeek-V3's multi-token-prediction layer (index num_hidden_layers, declared by num_nextn_predict_layers)
    and rotary inv_freq buffers are carried by real checkpoints and unused by decode: no error, no warning."""
    src = tiny_ckpt(DS)
    extra = {"model.layers.3.eh_proj.weight": torch.zeros(4, 4),
             "model.layers.3.mlp.experts.0.up_proj.weight": torch.zeros(4, 4),
             "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(4)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, got = load_weights(with_extra(src, tmp_path / "mtp", extra, num_nextn_predict_layers=1))
    assert not set(extra) & set(got)


def test_unknown_tensors_are_an_error_naming_them(tiny_ckpt, tmp_path):
    src = tiny_ckpt(DS)
    extra = {f"model.layers.{i}.mystery.weight": torch.zeros(2) for i in range(5)}
    ckpt = with_extra(src, tmp_path / "unknown", extra)  # no num_nextn_predict_layers: layer 3 is unknown too
    msg = load_error(ckpt)
    assert "5 tensors" in msg and "'model.layers.0.mystery.weight'" in msg and "and 2 more" in msg
    assert "--ignore-unknown-tensors" in msg
    with pytest.warns(UnknownTensorsWarning, match="model.layers.0.mystery.weight") as w:
        _, got = load_weights(ckpt, ignore_unknown=True)
    assert len(w) == 1 and not set(extra) & set(got)
    _, want = load_weights(src)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_bf16_checkpoint_loads_as_requested_dtype(tiny_ckpt):
    ckpt = tiny_ckpt(QWEN, dtype=torch.bfloat16)
    cfg, w = load_weights(ckpt, dtype=torch.float32)
    ref = random_weights(cfg, "cpu", torch.bfloat16, seed=0)
    for k in w:
        assert w[k].dtype == torch.float32
        assert torch.equal(w[k], ref[k].float()), k


def test_engine_from_checkpoint_matches_preset(tiny_ckpt):
    ckpt = tiny_ckpt(DS)
    prompt = [[256, 72, 105, 33]]
    a = Engine.from_pretrained(str(ckpt), max_batch=1, max_seq_len=16)
    b = Engine.from_pretrained(DS, max_batch=1, max_seq_len=16)
    # Same weights (bit for bit, above); memory layout may pick different kernels, so not bitwise.
    torch.testing.assert_close(a.prefill(prompt), b.prefill(prompt), rtol=1e-5, atol=1e-5)


# ---- defects ------------------------------------------------------------------------------------------

def load_error(ckpt, **kw) -> str:
    with pytest.raises(CheckpointError) as e:
        load_weights(ckpt, **kw)
    return str(e.value)


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.kv_a_layernorm.weight",
                                  "model.layers.2.mlp.gate.e_score_correction_bias", "lm_head.weight"])
def test_missing_tensor(tiny_ckpt, name):
    ckpt = tiny_ckpt(DS, shard_bytes=SMALL_SHARD)
    edit_shard(ckpt, name, lambda ts: ts.pop(name))
    # The index still lists it: the shard does not hold what the index promises.
    msg = load_error(ckpt)
    assert repr(name) in msg and weight_map(ckpt)[name] in msg
    # Gone from the index too: plainly missing.
    wm = weight_map(ckpt)
    del wm[name]
    (ckpt / INDEX).write_text(json.dumps({"weight_map": wm}))
    msg = load_error(ckpt)
    assert f"missing tensor {name!r}" in msg


def test_missing_tensor_single_file(tiny_ckpt, tmp_path):
    src = tiny_ckpt(DS)
    tensors = read_all(src)
    del tensors["model.norm.weight"]
    msg = load_error(single_file_checkpoint(src, tmp_path / "s", tensors))
    assert "missing tensor 'model.norm.weight' (shape [64])" in msg


def test_missing_expert_tensor(tiny_ckpt, tmp_path):
    src = tiny_ckpt(DS)
    tensors = read_all(src)
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    msg = load_error(single_file_checkpoint(src, tmp_path / "s", tensors))
    assert "'model.layers.2.mlp.experts.5.up_proj.weight'" in msg
    assert "'model.layers.2.mlp.experts.gate_up_proj'" in msg


@pytest.mark.parametrize("name, bad_shape", [
    ("model.layers.0.self_attn.o_proj.weight", (64, 63)),
    ("model.embed_tokens.weight", (258, 64)),
    ("model.layers.1.mlp.gate.e_score_correction_bias", (15,)),
    ("model.layers.1.mlp.experts.3.gate_proj.weight", (32, 65)),
    ("model.layers.2.mlp.experts.15.down_proj.weight", (32, 64)),  # transposed
])
def test_misshaped_tensor(tiny_ckpt, name, bad_shape):
    ckpt = tiny_ckpt(DS, shard_bytes=SMALL_SHARD)
    set_tensor(ckpt, name, torch.zeros(bad_shape))
    msg = load_error(ckpt)
    assert f"tensor {name!r} has shape {list(bad_shape)}" in msg


def test_misshaped_stacked_tensor(tiny_ckpt, tmp_path):
    src = tiny_ckpt(DS)
    cfg, w = load_weights(src)
    w["model.layers.1.mlp.experts.down_proj"] = w["model.layers.1.mlp.experts.down_proj"][:-1]
    msg = load_error(single_file_checkpoint(src, tmp_path / "s", w))
    assert "tensor 'model.layers.1.mlp.experts.down_proj' has shape [15, 64, 32], expected [16, 64, 32]" in msg


@pytest.mark.parametrize("name, dtype", [
    ("model.layers.0.input_layernorm.weight", torch.int32),
    ("model.layers.2.mlp.gate.e_score_correction_bias", torch.int64),
    ("model.layers.1.mlp.experts.7.down_proj.weight", torch.int8),
    ("model.norm.weight", torch.bool),
])
def test_integer_dtype_tensor(tiny_ckpt, name, dtype):
    ckpt = tiny_ckpt(DS, shard_bytes=SMALL_SHARD)
    shape = load_file(str(ckpt / weight_map(ckpt)[name]))[name].shape
    set_tensor(ckpt, name, torch.ones(shape, dtype=dtype))
    msg = load_error(ckpt)
    assert f"tensor {name!r} has dtype {dtype}" in msg


def test_index_names_missing_shard(tiny_ckpt):
    ckpt = tiny_ckpt(DS, shard_bytes=SMALL_SHARD)
    wm = weight_map(ckpt)
    wm["model.layers.1.self_attn.q_b_proj.weight"] = "model-00099-of-00099.safetensors"
    (ckpt / INDEX).write_text(json.dumps({"weight_map": wm}))
    msg = load_error(ckpt)
    assert "'model-00099-of-00099.safetensors'" in msg and "'model.layers.1.self_attn.q_b_proj.weight'" in msg


@pytest.mark.parametrize("text", ['{"weight_map": ', '{"metadata": {}}', '{"weight_map": ["a"]}', "[]"])
def test_broken_index(tiny_ckpt, text):
    ckpt = tiny_ckpt(DS)
    (ckpt / INDEX).write_text(text)
    assert INDEX in load_error(ckpt)


def test_corrupt_shard_names_the_file(tiny_ckpt):
    ckpt = tiny_ckpt(DS, shard_bytes=SMALL_SHARD)
    shard = sorted(ckpt.glob("*.safetensors"))[1]
    shard.write_bytes(b"\x00" * 8 + b"not a safetensors header")
    assert shard.name in load_error(ckpt)


def test_duplicate_tensor_in_two_files(tiny_ckpt, tmp_path):
    src = tiny_ckpt(DS)
    dst = single_file_checkpoint(src, tmp_path / "dup", read_all(src))
    save_file({"model.norm.weight": torch.ones(64)}, str(dst / "extra.safetensors"))
    msg = load_error(dst)
    assert "'model.norm.weight'" in msg and "extra.safetensors" in msg


def test_dir_without_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(preset_hf_config(DS)))
    assert "no *.safetensors files" in load_error(tmp_path)


def test_not_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        load_weights(tmp_path / "nope", preset_config(DS))
    with pytest.raises(ConfigError, match="no config.json"):
        load_weights(tmp_path / "nope")


def test_wrong_config_for_checkpoint(tiny_ckpt):
    ckpt = tiny_ckpt(QWEN)
    msg = load_error(ckpt, cfg=preset_config(DS))
    assert "missing tensor 'model.layers.0.self_attn.q_a_proj.weight'" in msg
    assert "does not use" not in msg  # what the config misses, not the other model's tensors, is the message


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("name", ["model.layers.0.mlp.gate_proj.weight",
                                  "model.layers.1.mlp.gate.e_score_correction_bias",
                                  "model.layers.2.mlp.experts.9.up_proj.weight"])
def test_non_finite_weight_only_checked_on_request(tiny_ckpt, name, bad):
    ckpt = tiny_ckpt(DS, shard_bytes=SMALL_SHARD)
    t = load_file(str(ckpt / weight_map(ckpt)[name]))[name].clone()
    t.view(-1)[3] = bad
    set_tensor(ckpt, name, t)
    cfg, w = load_weights(ckpt)  # no check: loads, the value is kept
    if ".experts." in name:
        got = w["model.layers.2.mlp.experts.gate_up_proj"][9, cfg.moe_intermediate_size:].reshape(-1)[3]
    else:
        got = w[name].view(-1)[3]
    assert (got.isnan() if math.isnan(bad) else got == bad)
    msg = load_error(ckpt, check_finite=True)
    assert f"tensor {name!r} contains NaN or inf" in msg
    with pytest.raises(CheckpointError, match="NaN or inf"):
        Engine.from_pretrained(str(ckpt), check_finite=True, max_batch=1, max_seq_len=8)


def test_cast_overflow_is_caught_with_check_finite(tiny_ckpt):
    ckpt = tiny_ckpt(QWEN, shard_bytes=SMALL_SHARD)
    name = "model.layers.0.self_attn.q_norm.weight"
    set_tensor(ckpt, name, torch.full((16,), 1e6))  # finite in fp32, inf in fp16
    load_weights(ckpt, dtype=torch.float16)
    load_weights(ckpt, dtype=torch.bfloat16, check_finite=True)  # bf16 holds 1e6
    msg = load_error(ckpt, dtype=torch.float16, check_finite=True)
    assert repr(name) in msg and "float16" in msg


def test_checkpoint_error_is_a_value_error():
    assert issubclass(CheckpointError, ValueError)


def test_make_checkpoint_from_dict(tmp_path):
    d = preset_hf_config(QWEN)
    d["num_hidden_layers"] = 2
    d["mlp_only_layers"] = []
    ckpt = make_checkpoint(tmp_path / "c", d, dtype=torch.float32)
    cfg, w = load_weights(ckpt)
    assert cfg.num_layers == 2 and all(cfg.moe_layers)
    assert "model.layers.1.mlp.experts.gate_up_proj" in w and "model.layers.2.input_layernorm.weight" not in w
    assert "torch_dtype" not in d  # the caller's dict is not modified


def test_make_checkpoint_refuses_a_file_and_a_non_empty_directory(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(CheckpointError, match="it exists and is not a directory"):
        make_checkpoint(f, QWEN)
    other = make_checkpoint(tmp_path / "other", DS, dtype=torch.float32)
    config = (other / "config.json").read_text()
    with pytest.raises(CheckpointError, match=r"is not empty \(it holds config.json"):
        make_checkpoint(other, QWEN)
    assert (other / "config.json").read_text() == config  # the other model's files are untouched
    (other / "model-00009-of-00009.safetensors").write_bytes(b"stale")
    make_checkpoint(other, QWEN, dtype=torch.float32, overwrite=True)
    assert not (other / "model-00009-of-00009.safetensors").exists()  # no stale shard beside the new ones
    cfg, _ = load_weights(other)
    assert cfg.family == "qwen3_moe"
    (tmp_path / "empty").mkdir()
    make_checkpoint(tmp_path / "empty", QWEN, dtype=torch.float32)  # an empty directory is fine
