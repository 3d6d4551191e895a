"""kimi_k3 under the `graph` executor: decode steps of <= 16 sequences route the LatentMoE experts through the
fused Triton kernel (megadecode/kernels/fused_experts.py), which the torch executor's reference loop checks.

On the CPU this runs eagerly, fp32, under the Triton interpreter. TRITON_INTERPRET=1 is set around the kernel
import (the @jit functions are decorated then) and per test by a fixture. When another test module imported
triton first, the interpreter tests skip here and test_rerun_in_subprocess_when_not_interpreted reruns this
file in a fresh interpreter (the pattern of tests/test_fused_experts.py).
"""

from __future__ import annotations


import pytest
import torch

from interp import ON_GPU, import_interpreted, rerun_file_in_subprocess  # noqa: E402

FE = import_interpreted("megadecode.kernels.fused_experts")

from megadecode import Engine  # noqa: E402
from megadecode import plan as P  # noqa: E402
from megadecode.executors import torch_ops  # noqa: E402
from megadecode.executors.graph_executor import check_capture  # noqa: E402
from megadecode.executors.torch_ops import OP_IMPLS, StepContext  # noqa: E402
from megadecode.presets import preset_config  # noqa: E402
from megadecode.reference.moe import route  # noqa: E402
from megadecode.step import Step  # noqa: E402
from megadecode.validate.variant import triton_interpreted  # noqa: E402
from megadecode.weights import random_weights  # noqa: E402

TRITON_OK = ON_GPU or triton_interpreted(FE.experts_up_kernel)
needs_triton = pytest.mark.skipif(not TRITON_OK, reason="kernels imported without TRITON_INTERPRET: see "
                                                        "test_rerun_in_subprocess_when_not_interpreted")
DEVICE = "cuda" if ON_GPU else "cpu"
CFG = preset_config("tiny-k3")
PROMPTS = [[256, 72, 101, 108, 108, 111, 33], [256, 7], [256, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
MOE_LAYERS = sum(CFG.moe_layers)


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def weights():
    return random_weights(CFG, DEVICE, torch.float32, seed=1)


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts the fused kernel's calls (torch_ops looks it up on the module at each call)."""
    calls = []
    real = FE.fused_experts

    def counting(*a, **kw):
        calls.append(a[0].shape[0])
        return real(*a, **kw)
    monkeypatch.setattr(FE, "fused_experts", counting)
    return calls


def _greedy(weights, executor, steps=12):
    e = Engine(CFG, weights, executor=executor, max_batch=4, max_seq_len=32)
    logits = [e.prefill(PROMPTS)]
    toks = [logits[-1].argmax(-1)]
    for _ in range(steps):
        logits.append(e.decode(toks[-1]).clone())
        toks.append(logits[-1].argmax(-1))
    return torch.stack(toks, 1), torch.stack(logits, 1)


@needs_triton
def test_graph_decode_matches_torch_over_12_steps(weights, fused_calls):
    tok_t, log_t = _greedy(weights, "torch")
    assert fused_calls == []  # the torch executor stays the reference loop
    tok_g, log_g = _greedy(weights, "graph")
    # prefill keeps the reference loop; every decode step's LatentMoE layers take the fused kernel
    assert fused_calls == [len(PROMPTS)] * (12 * MOE_LAYERS)
    assert torch.equal(tok_g, tok_t)
    err = (log_g[:, 1:] - log_t[:, 1:]).abs().max().item()
    assert err <= 1e-4 * log_t[:, 1:].abs().max().item(), err
    torch.testing.assert_close(log_g[:, 0], log_t[:, 0], rtol=0, atol=0)  # same prefill path


def _latent_op_pair(weights, T, layer=3, seed=2):
    """The LATENT_MOE op on one decode-shaped step of T tokens, run as the graph executor and as the
    reference (same inputs). Returns (graph-path output, reference output)."""
    m = f"model.layers.{layer}.mlp"
    x = torch.randn(T, CFG.hidden_size, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    ids, rw = route(CFG, x, weights[f"{m}.gate.weight"], weights[f"{m}.gate.e_score_correction_bias"])
    op = next(o for o in P.build_plan(CFG).ops if o.layer == layer and o.kind == P.LATENT_MOE)
    n = torch.arange(T, device=DEVICE)
    out = []
    for impl in ("grouped", "reference"):
        ctx = StepContext(CFG, weights, None, Step(tokens=n, positions=n, slots=n, logit_rows=n, kv_len=T,
                                                   contiguous_slots=True), impl)
        ctx.buf.update(normed=x.clone(), topk_ids=ids.clone(), topk_weights=rw.clone())
        OP_IMPLS[P.LATENT_MOE](ctx, op)
        out.append(ctx.buf["moe_out"])
    return out


@needs_triton
def test_graph_latent_op_equals_reference_op(weights, fused_calls):
    got, want = _latent_op_pair(weights, 5)
    assert fused_calls == [5]
    err = (got - want).abs().max().item()
    assert err <= 1e-5 * want.abs().max().item(), err


@needs_triton
def test_over_16_tokens_takes_the_reference_loop(weights, fused_calls):
    got, want = _latent_op_pair(weights, 17)
    assert fused_calls == []
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_capture_refuses_k3_above_16_sequences():
    assert torch_ops.LATENT_FUSED_MAX_TOKENS == FE.MAX_TOKENS == 16
    k3 = P.build_plan(CFG)
    for b in (1, 8, 16):
        check_capture(k3, b)
    with pytest.raises(ValueError, match=r"at most 16 sequences \(got 17\).*grouped MXFP4 expert path"):
        check_capture(k3, 17)
    check_capture(P.build_plan(preset_config("tiny-deepseek-v3")), 64)  # only LatentMoE plans are limited


def test_rerun_in_subprocess_when_not_interpreted():
    """When triton was imported without the interpreter before this module, run this file afresh."""
    if TRITON_OK:
        pytest.skip("the interpreter tests ran in this process")
    rerun_file_in_subprocess(__file__)
