"""FP8 experts on the GPU (skipped without CUDA): backends/fused/kernels/fp8_experts.py in bf16 against the dequantized fp32
reference, captured in a CUDA graph, at Qwen3-30B-A3B-FP8's expert shape; and the graph / fused executors on an
FP8 preset against the torch executor."""

from __future__ import annotations

import pytest
import torch

from megadecode import Engine, SamplingParams
from megadecode.presets import preset_config
from megadecode.quant.fp8 import FP8Tensor, scale_shape
from megadecode.reference.moe import experts_reference
from megadecode.weights import ParamSpec, random_tensor, random_weights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [[256, 72, 101, 108, 108, 111], [256, 7], [256, 1, 2, 3, 4, 5, 6, 7, 8, 9], [256, 40, 41]]


def _stack(E, out_dim, in_dim, gen, block=(128, 128)):
    shape = (E, out_dim, in_dim)
    v = random_tensor(ParamSpec("w", shape, "fp8"), gen, "cuda", torch.bfloat16)
    s = random_tensor(ParamSpec("s", scale_shape(shape, block), "fp8_scale", block=block), gen, "cuda", torch.float32)
    return FP8Tensor(v, s, block)


@pytest.mark.parametrize("T", [1, 8, 64])
def test_qwen3_30b_fp8_experts_bf16_close_to_reference_and_capturable(T):
    from megadecode.backends.fused.kernels.fp8_experts import fp8_experts

    D, I, E, A = 2048, 768, 128, 8
    gen = torch.Generator(device="cuda").manual_seed(T)
    gu, dn = _stack(E, 2 * I, D, gen), _stack(E, D, I, gen)
    x = torch.randn(T, D, device="cuda", generator=gen).bfloat16()
    ids = torch.argsort(torch.rand(T, E, device="cuda", generator=gen), dim=1)[:, :A].contiguous()
    w = torch.rand(T, A, device="cuda", generator=gen) + 0.1
    ref = experts_reference(x.float(), ids, w, gu, dn)
    out = fp8_experts(x, ids, w, gu, dn)
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < 2e-2, f"bf16 FP8 experts vs fp32 reference: relative error {err:.2e}"
    graph, static = torch.cuda.CUDAGraph(), torch.empty_like(out)
    fp8_experts(x, ids, w, gu, dn, out=static)  # warm-up (compiles)
    with torch.cuda.graph(graph):
        fp8_experts(x, ids, w, gu, dn, out=static)
    static.zero_()
    graph.replay()
    assert torch.equal(static, out)  # deterministic, and the captured call recomputes everything


@pytest.mark.parametrize("executor", ["graph", "fused"])
@pytest.mark.parametrize("preset", ["tiny-qwen3-moe-fp8", "tiny-deepseek-v3-fp8"])
def test_fp8_presets_fp32_greedy_like_torch(preset, executor):
    cfg = preset_config(preset)
    w = random_weights(cfg, "cuda", torch.float32, seed=1)
    ref = Engine(cfg, w, executor="torch", max_batch=8, max_seq_len=128)
    fast = Engine(cfg, w, executor=executor, max_batch=8, max_seq_len=128)
    a = ref.generate(PROMPTS, 24, SamplingParams(greedy=True), stop_at_eos=False)
    b = fast.generate(PROMPTS, 24, SamplingParams(greedy=True), stop_at_eos=False)
    assert a.token_ids == b.token_ids
    if executor == "fused":
        assert fast.executor.chosen[("experts", len(PROMPTS))] == "triton-fp8-experts"
