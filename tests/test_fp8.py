"""FP8 block-scaled checkpoints (quantization_config fp8: float8_e4m3fn weights, one weight_scale_inv per block)
as DeepSeek-V3, Kimi K2 and Qwen3-*-FP8 ship them: the dequantization rule (quant/fp8.py), loading (routed experts
kept FP8, the rest dequantized), a model against its dequantized reference (the transformers oracle on the
dequantized checkpoint, executors torch, graph and fused), and the errors for broken ones."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from megadecode import Engine
from megadecode.checkpoint import CheckpointError, load_weights, make_checkpoint
from megadecode.presets import preset_config, preset_hf_config
from megadecode.quant.fp8 import FP8, FP8Tensor, dequantize_fp8, quantize_fp8, scale_shape
from megadecode.weights import weight_bytes

transformers = pytest.importorskip("transformers")

from hf_oracle import hf_teacher_forced, load_oracle, rel_err, relayout, save_with_transformers  # noqa: E402
from interp import DEVICE  # noqa: E402

BLOCK = (32, 32)
QCFG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
PROMPTS = [[256, 72, 101, 108, 108, 111], [256, 7, 8]]
CONT = [[40, 41, 42, 43], [50, 51, 52, 53]]
RTOL = 1e-4


# ---- the format --------------------------------------------------------------------------------------

def test_dequantize_is_each_value_times_its_block_scale():
    """Partial blocks at the bottom and right edges: [5, 7] weights in blocks of 2 x 3."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(5, 7, generator=g) * 50).to(FP8)
    s = torch.rand(3, 3, generator=g) + 0.5
    got = dequantize_fp8(w, s, (2, 3))
    for n in range(5):
        for k in range(7):
            assert got[n, k] == w[n, k].float() * s[n // 2, k // 3]
    assert torch.equal(dequantize_fp8(w, s.bfloat16(), (2, 3)), w.float() * s.bfloat16().float().repeat_interleave(
        2, 0)[:5].repeat_interleave(3, 1)[:, :7])


def test_quantize_rounds_each_block_to_e4m3():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(2, 70, 45, generator=g)
    q, s = quantize_fp8(w, BLOCK)
    assert q.dtype == FP8 and s.dtype == torch.float32 and tuple(s.shape) == scale_shape(tuple(w.shape), BLOCK)
    err = (dequantize_fp8(q, s, BLOCK) - w).abs()
    half_ulp = 16 * s.repeat_interleave(32, -2)[:, :70].repeat_interleave(32, -1)[..., :45]  # 448's binade: ulp 32
    assert (err <= half_ulp).all()
    assert q.float().abs().amax() == 448  # each block's largest value lands on e4m3's largest


def test_fp8_tensor_checks_its_scales():
    q, s = quantize_fp8(torch.randn(3, 64, 40), BLOCK)
    t = FP8Tensor(q, s, BLOCK)
    assert torch.equal(t[1].dequantize(), dequantize_fp8(q[1], s[1], BLOCK)) and t.nbytes == q.numel() + 4 * s.numel()
    with pytest.raises(ValueError, match=r"needs weight_scale_inv \[3, 2, 2\]"):
        FP8Tensor(q, s[:, :1], BLOCK)


# ---- loading -----------------------------------------------------------------------------------------

def fp8_weight(name: str, t: torch.Tensor) -> bool:
    """What DeepSeek-V3's FP8 checkpoints store in FP8: the linears of attention and MLP, not the router."""
    return t.dim() == 2 and bool(re.search(r"\.(self_attn|mlp|block_sparse_moe)\.", name)) and \
        not name.endswith(".gate.weight")


def quantize_checkpoint(ts: dict) -> dict:
    out = {}
    for n, t in ts.items():
        if fp8_weight(n, t):
            out[n], out[n.removesuffix("weight") + "weight_scale_inv"] = quantize_fp8(t, BLOCK)
        else:
            out[n] = t
    return out


def dequantize_checkpoint(ts: dict) -> dict:
    """The float checkpoint an FP8 one stands for, by the rule written out: value times its block's scale."""
    out = {}
    for n, t in ts.items():
        if n.endswith("weight_scale_inv"):
            continue
        if t.dtype == FP8:
            s = ts[n.removesuffix("weight") + "weight_scale_inv"]
            full = s.repeat_interleave(BLOCK[0], 0)[:t.shape[0]].repeat_interleave(BLOCK[1], 1)[:, :t.shape[1]]
            t = t.float() * full
        out[n] = t
    return out


@pytest.fixture(scope="module", params=["tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-kimi-linear"])
def fp8_pair(request, tmp_path_factory):
    """(preset, FP8 checkpoint, its dequantized float checkpoint, the oracle's logits on the latter): both made from
    a checkpoint transformers wrote (save_pretrained: hub names), quantized in blocks of 32 x 32."""
    preset = request.param
    tmp = tmp_path_factory.mktemp(preset + "-fp8")
    src = save_with_transformers(preset, tmp / "float")
    d = json.loads((src / "config.json").read_text())
    fp8 = relayout(src, tmp / "fp8", quantize_checkpoint, config={**d, "quantization_config": QCFG})
    ref = relayout(fp8, tmp / "deq", dequantize_checkpoint, config=d)
    hf = load_oracle(ref)
    logits = [torch.stack(hf_teacher_forced(hf, p, c)) for p, c in zip(PROMPTS, CONT)]
    return preset, fp8, ref, logits


def test_experts_stay_fp8_and_the_rest_is_dequantized(fp8_pair):
    _, fp8, ref, _ = fp8_pair
    cfg, w = load_weights(fp8)
    _, want = load_weights(ref)
    assert cfg.expert_quant == "fp8" and cfg.weight_block == BLOCK
    files = load_file(str(fp8 / "model.safetensors"))
    n_fp8 = sum(t.dtype == FP8 for t in files.values())
    assert n_fp8 > 3 * cfg.num_experts  # the experts and the trunk's linears are FP8 in the file
    experts = [n for n in w if re.search(r"experts\.(gate_up|down)_proj$", n)]
    assert experts
    for name, t in w.items():
        if name in experts:
            assert t.dtype == FP8, name
            deq = FP8Tensor(t, w[name + "_scale_inv"], BLOCK).dequantize()
            assert torch.equal(deq, want[name]), name  # the same numbers as the dequantized file
        elif not name.endswith("_scale_inv"):
            assert t.dtype == torch.float32 and torch.equal(t, want[name]), name


@pytest.mark.parametrize("executor", ["torch", "graph", "fused"])
def test_fp8_model_decodes_like_its_dequantized_reference(fp8_pair, executor):
    """Our engine on the FP8 checkpoint against transformers on the dequantized one (kimi_linear: torch only, the
    fused executor does not run its family; graph on the CPU decodes FP8 experts with the Triton kernels under
    the interpreter)."""
    preset, fp8, _, ref = fp8_pair
    if executor != "torch" and preset == "tiny-kimi-linear":
        pytest.skip("kimi_linear runs on the torch and graph executors; graph is covered by the other families")
    eng = Engine.from_pretrained(str(fp8), executor=executor, max_batch=len(PROMPTS), max_seq_len=32,
                                 device=DEVICE)
    logits = [eng.prefill(PROMPTS, len(CONT[0]))]
    for s in range(len(CONT[0])):
        # .clone(): on the GPU graph / fused return the captured graph's output buffer, rewritten by the next step
        logits.append(eng.decode(torch.tensor([c[s] for c in CONT], device=DEVICE)).clone())
    ours = torch.stack(logits, 1).cpu()
    for b in range(len(PROMPTS)):
        err = rel_err(ours[b], ref[b])
        assert err <= RTOL, f"{preset} {executor} prompt {b}: max relative logit error {err:.2e}"
    if executor == "fused":
        assert eng.executor.chosen[("experts", len(PROMPTS))] == "triton-fp8-experts"


def test_graph_decode_runs_the_fp8_kernels(monkeypatch):
    """The graph executor's decode steps run backends/fused/kernels/fp8_experts.py (sync-free), its prefill the reference ops. On the
    GPU the decode step is captured in a CUDA graph: the kernels are called while it is warmed up and captured."""
    from interp import import_interpreted

    mod = import_interpreted("megadecode.backends.fused.kernels.fp8_experts")
    calls = []
    real = mod.fp8_experts
    monkeypatch.setattr(mod, "fp8_experts", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    eng = Engine.from_pretrained("tiny-qwen3-moe-fp8", executor="graph", max_batch=2, max_seq_len=16, device=DEVICE)
    eng.prefill([[256, 1, 2], [256, 3]], 2)
    assert calls == []
    eng.decode(torch.tensor([4, 5], device=DEVICE))
    # batch 2, the two MoE layers of tiny-qwen3-moe: once on the CPU, per warm-up and capture run on the GPU
    assert calls and set(calls) == {2} and len(calls) % 2 == 0 and (DEVICE == "cuda" or len(calls) == 2), calls


def test_memory_counts_fp8_experts_at_one_byte():
    cfg = preset_config("qwen3-30b-a3b-fp8")
    D, I = cfg.hidden_size, cfg.moe_intermediate_size
    scales = 4 * (2 * I // 128 * D // 128 + D // 128 * I // 128)
    assert weight_bytes(cfg, 2)["expert"] == 3 * D * I + scales
    assert weight_bytes(preset_config("qwen3-30b-a3b"), 2)["expert"] == 2 * 3 * D * I


def test_make_checkpoint_writes_fp8_as_the_hub_does(tmp_path):
    ckpt = make_checkpoint(tmp_path / "c", "tiny-deepseek-v3-fp8", dtype=torch.float32)
    ts = load_file(str(next(ckpt.glob("*.safetensors"))))
    p = "model.layers.1"
    assert ts[f"{p}.mlp.experts.3.up_proj.weight"].dtype == FP8
    assert ts[f"{p}.mlp.experts.3.up_proj.weight_scale_inv"].shape == (1, 2)
    assert ts[f"{p}.self_attn.kv_a_proj_with_mqa.weight"].dtype == FP8  # [40, 64]: a partial block row
    assert ts[f"{p}.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (2, 2)
    assert ts[f"{p}.mlp.gate.weight"].dtype == torch.float32 and ts[f"{p}.input_layernorm.weight"].dtype != FP8
    cfg, w = load_weights(ckpt)
    assert w[f"{p}.mlp.experts.gate_up_proj"].dtype == FP8 and cfg.expert_quant == "fp8"


# ---- broken FP8 checkpoints --------------------------------------------------------------------------

def broken(fp8_ckpt, tmp_path, fn, config=None) -> str:
    with pytest.raises(CheckpointError) as e:
        load_weights(relayout(fp8_ckpt, tmp_path / "b", fn, config=config))
    return str(e.value)


@pytest.fixture(scope="module")
def qwen_fp8(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("q8") / "c", "tiny-qwen3-moe-fp8", dtype=torch.float32)


Q = "model.layers.0.self_attn.q_proj.weight"
EXPERT = "model.layers.2.mlp.experts.1.down_proj.weight"


def test_fp8_weight_without_its_scale(qwen_fp8, tmp_path):
    def drop(ts):
        del ts[Q.removesuffix("weight") + "weight_scale_inv"]
        return ts
    msg = broken(qwen_fp8, tmp_path, drop)
    assert f"{Q!r} is float8_e4m3fn, but the checkpoint has no 'model.layers.0.self_attn.q_proj.weight_scale_inv'" in msg


def test_scale_of_the_wrong_shape(qwen_fp8, tmp_path):
    def cut(ts):
        n = Q.removesuffix("weight") + "weight_scale_inv"
        ts[n] = ts[n][:1].clone()
        return ts
    assert f"tensor {Q!r}: FP8 weight (64, 64) with blocks [32, 32] needs weight_scale_inv [2, 2]" in broken(
        qwen_fp8, tmp_path, cut)


def test_fp8_tensors_without_quantization_config(qwen_fp8, tmp_path):
    d = preset_hf_config("tiny-qwen3-moe")
    msg = broken(qwen_fp8, tmp_path, lambda ts: ts, config=d)
    assert re.search(r"holds FP8 weights \('model\.layers\.\d\.[\w.]+\.weight_scale_inv'\), but config\.json has no "
                     r"FP8 quantization_config", msg), msg


def test_float_experts_under_an_fp8_config(qwen_fp8, tmp_path):
    def unquantize(ts):
        ts[EXPERT] = ts[EXPERT].float()
        return ts
    msg = broken(qwen_fp8, tmp_path, unquantize)
    assert f"tensor {EXPERT!r} has dtype torch.float32; expected float8_e4m3fn" in msg


def test_scale_of_a_weight_stored_in_float(qwen_fp8, tmp_path):
    def unquantize(ts):
        ts[Q] = ts[Q].float()
        return ts
    assert "'model.layers.0.self_attn.q_proj.weight_scale_inv', the FP8 scale of a weight that is not stored in " \
           "FP8" in broken(qwen_fp8, tmp_path, unquantize)


def test_nan_code_only_checked_on_request(qwen_fp8, tmp_path):
    def poison(ts):
        ts[EXPERT] = ts[EXPERT].clone()
        ts[EXPERT].view(torch.uint8).view(-1)[5] = 0x7F  # e4m3fn NaN
        return ts
    ckpt = relayout(qwen_fp8, tmp_path / "nan", poison)
    load_weights(ckpt)
    with pytest.raises(CheckpointError, match=f"tensor {EXPERT!r} contains NaN or inf"):
        load_weights(ckpt, check_finite=True)
