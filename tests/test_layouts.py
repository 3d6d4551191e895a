"""Checkpoints written by transformers itself (save_pretrained of a tiny model of each family, pinned 5.17.0),
re-laid out into every tensor-name layout real checkpoints of the family use (megadecode/layouts.py): each
loads, gives the same weights, and decodes the transformers oracle's logits. The names the newest transformers
5.x wrote (tests/data/layout_names-*.json.gz, from tests/data/make_layout_names.py) load too. Broken layouts
(duplicates, missing pieces, experts beyond the config) are errors naming the tensor."""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megadecode import Engine
from megadecode.checkpoint import CheckpointError, load_weights
from megadecode.config import config_from_hf
from megadecode.presets import preset_config
from megadecode.weights import random_weights

transformers = pytest.importorskip("transformers")

from hf_oracle import CLASSES, hf_teacher_forced, load_oracle, rel_err, relayout, save_with_transformers  # noqa: E402
PROMPTS = [[256, 72, 101, 108, 108, 111], [256, 7, 8]]
CONT = [[40, 41, 42, 43], [50, 51, 52, 53]]  # fed to both sides, one token per decode step
RTOL = 1e-4
DATA = Path(__file__).parent / "data"


def dense_back_to_mlp(ts: dict) -> dict:
    """Kimi-Linear's hub layout from save_pretrained's: the dense layers' MLP under `mlp.`."""
    return {re.sub(r"\.block_sparse_moe\.(gate_proj|up_proj|down_proj)\.", r".mlp.\1.", k): v for k, v in ts.items()}


def experts_per_expert_mlp(ts: dict) -> dict:
    """transformers' own kimi_linear names with the experts split per expert (`mlp.experts.{j}.w1|w3|w2`, the
    per-expert spelling transformers' conversion also reads)."""
    out = {}
    for k, v in ts.items():
        m = re.match(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$", k)
        if not m:
            out[k] = v
            continue
        for j, e in enumerate(v):
            if m.group(2) == "down_proj":
                out[f"{m.group(1)}.{j}.w2.weight"] = e
            else:
                out[f"{m.group(1)}.{j}.w1.weight"], out[f"{m.group(1)}.{j}.w3.weight"] = e.chunk(2, 0)
    return out


@pytest.fixture(scope="module", params=sorted(CLASSES))
def family(request, tmp_path_factory):
    """(preset, {layout: checkpoint dir}, the oracle's logits per prompt)."""
    preset = request.param
    tmp = tmp_path_factory.mktemp(preset)
    written = save_with_transformers(preset, tmp / "save_pretrained")
    layouts = {"save_pretrained": written,
               "transformers_own": save_with_transformers(preset, tmp / "own", original=False)}
    if preset == "tiny-kimi-linear":
        layouts["hub"] = relayout(written, tmp / "hub", dense_back_to_mlp)
        layouts["own_per_expert"] = relayout(layouts["transformers_own"], tmp / "ppe", experts_per_expert_mlp)
    hf = load_oracle(written)
    ref = [torch.stack(hf_teacher_forced(hf, p, c)) for p, c in zip(PROMPTS, CONT)]
    return preset, layouts, ref


def test_layouts_differ(family):
    """The layouts really spell the tensors differently (else the test below would prove nothing)."""
    _, layouts, _ = family
    names = {k: frozenset(load_file(str(next(d.glob("*.safetensors"))))) for k, d in layouts.items()}
    assert len(set(names.values())) == len(names)


def test_every_layout_loads_the_same_weights(family):
    preset, layouts, _ = family
    want = random_weights(preset_config(preset), seed=5)
    for layout, ckpt in layouts.items():
        _, w = load_weights(ckpt)
        assert set(w) == set(want), layout
        for k in want:
            assert torch.equal(w[k], want[k]), (layout, k)


def test_every_layout_decodes_like_transformers(family):
    preset, layouts, ref = family
    for layout, ckpt in layouts.items():
        eng = Engine.from_pretrained(str(ckpt), max_batch=len(PROMPTS), max_seq_len=32)
        logits = [eng.prefill(PROMPTS, len(CONT[0]))]
        for s in range(len(CONT[0])):
            logits.append(eng.decode(torch.tensor([c[s] for c in CONT])))
        ours = torch.stack(logits, 1)
        for b in range(len(PROMPTS)):
            err = rel_err(ours[b], ref[b])
            assert err <= RTOL, f"{preset} {layout} prompt {b}: max relative logit error {err:.2e}"


# ---- the newest transformers' names ---------------------------------------------------------------

def newest_names() -> dict:
    files = sorted(DATA.glob("layout_names-*.json.gz"),
                   key=lambda p: [int(x) for x in p.name.split("-")[1].removesuffix(".json.gz").split(".")])
    return json.loads(gzip.decompress(files[-1].read_bytes()))


@pytest.mark.parametrize("preset", sorted(CLASSES))
@pytest.mark.parametrize("style", ["save_pretrained", "save_original_format=False"])
def test_names_of_the_newest_transformers_load(preset, style, tmp_path):
    """Every tensor name and shape the newest transformers 5.x wrote (pinned in tests/data) maps onto the weight
    table, and its config.json reads as the preset."""
    doc = newest_names()
    entry = doc["models"][preset]
    cfg = config_from_hf(entry["config"])
    # DeepseekV3Config writes its default num_nextn_predict_layers, 1, with no MTP layer saved behind it
    assert cfg.num_mtp_layers == (1 if entry["config"]["model_type"] == "deepseek_v3" else 0)
    assert dataclasses.replace(cfg, num_mtp_layers=0) == preset_config(preset), doc["transformers"]
    gen = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(shape, generator=gen) for k, shape in entry[style].items()}
    (tmp_path / "config.json").write_text(json.dumps(entry["config"]))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    _, w = load_weights(tmp_path)
    assert set(w) == set(random_weights(cfg))
    # spot checks: a tensor stored under another name, and the gate rows of a stacked expert
    p = "model.layers.1"
    if preset == "tiny-kimi-linear" and style == "save_pretrained":
        assert torch.equal(w[f"{p}.self_attn.forget_gate.A_log"], tensors[f"{p}.self_attn.A_log"])
        conv = [tensors[f"{p}.self_attn.{x}_conv1d.weight"] for x in "qkv"]
        assert torch.equal(w[f"{p}.self_attn.conv1d.weight"], torch.cat(conv))
        assert torch.equal(w[f"{p}.mlp.experts.gate_up_proj"][3, :32],
                           tensors[f"{p}.block_sparse_moe.experts.3.w1.weight"])
        assert torch.equal(w["model.layers.0.mlp.up_proj.weight"],
                           tensors["model.layers.0.block_sparse_moe.up_proj.weight"])
    if preset == "tiny-qwen3-moe" and style == "save_pretrained":
        assert torch.equal(w["model.layers.0.mlp.experts.gate_up_proj"][5, 32:],
                           tensors["model.layers.0.mlp.experts.5.up_proj.weight"])


# ---- broken layouts ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def kimi_hub(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kimi-broken")
    return relayout(save_with_transformers("tiny-kimi-linear", tmp / "w"), tmp / "hub", dense_back_to_mlp)


def load_error(src: Path, dst: Path, fn) -> str:
    with pytest.raises(CheckpointError) as e:
        load_weights(relayout(src, dst, fn))
    return str(e.value)


def test_one_tensor_in_two_spellings_is_an_error(kimi_hub, tmp_path):
    def both(ts):
        ts["model.layers.0.block_sparse_moe.up_proj.weight"] = ts["model.layers.0.mlp.up_proj.weight"].clone()
        return ts
    msg = load_error(kimi_hub, tmp_path / "x", both)
    assert "'model.layers.0.block_sparse_moe.up_proj.weight'" in msg and "'model.layers.0.mlp.up_proj.weight'" in msg


def test_missing_conv_part_is_named_in_the_checkpoints_spelling(kimi_hub, tmp_path):
    def drop(ts):
        del ts["model.layers.1.self_attn.v_conv1d.weight"]
        return ts
    msg = load_error(kimi_hub, tmp_path / "x", drop)
    assert "'model.layers.1.self_attn.v_conv1d.weight'" in msg and "'model.layers.1.self_attn.conv1d.weight'" in msg


def test_missing_tensor_names_the_spellings_looked_for(kimi_hub, tmp_path):
    def drop(ts):
        for x in "qkv":
            del ts[f"model.layers.0.self_attn.{x}_conv1d.weight"]
        return ts
    msg = load_error(kimi_hub, tmp_path / "x", drop)
    assert "missing tensor 'model.layers.0.self_attn.conv1d.weight'" in msg
    assert "'model.layers.0.self_attn.q_conv1d.weight'" in msg


def test_missing_expert_in_the_hub_spelling(kimi_hub, tmp_path):
    def drop(ts):
        del ts["model.layers.2.block_sparse_moe.experts.7.w3.weight"]
        return ts
    msg = load_error(kimi_hub, tmp_path / "x", drop)
    assert "first 'model.layers.2.block_sparse_moe.experts.7.w3.weight'" in msg


def test_experts_beyond_the_config_are_unknown(kimi_hub, tmp_path):
    def extra(ts):
        p = "model.layers.1.block_sparse_moe.experts"
        ts[f"{p}.16.w1.weight"] = ts[f"{p}.0.w1.weight"].clone()
        return ts
    msg = load_error(kimi_hub, tmp_path / "x", extra)
    assert "1 tensor that a kimi_linear model" in msg
    assert "'model.layers.1.block_sparse_moe.experts.16.w1.weight'" in msg


def test_stacked_and_per_expert_together_is_an_error(tmp_path):
    src = save_with_transformers("tiny-qwen3-moe", tmp_path / "w")
    stacked = random_weights(preset_config("tiny-qwen3-moe"), seed=5)["model.layers.2.mlp.experts.down_proj"]

    def both(ts):
        ts["model.layers.2.mlp.experts.down_proj"] = stacked
        return ts
    msg = load_error(src, tmp_path / "x", both)
    assert "both the stacked 'model.layers.2.mlp.experts.down_proj' and per-expert tensors" in msg
