"""kimi_k3 under the `graph` executor: decode steps route the LatentMoE experts through the Triton routed
experts (the fused small-batch kernels at <= 16 sequences, the grouped kernels above), which the torch
executor's reference loop checks.

On the CPU this runs eagerly, fp32, under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1
before anything imports triton).
"""

from __future__ import annotations


import pytest
import torch

from interp import (  # noqa: E402, F401 (interpreter_env: an autouse fixture, imported to apply here)
    ON_GPU, DEVICE, import_interpreted, interpreter_env, triton_gate,
)

FE = import_interpreted("megadecode.backends.fused.kernels.fused_experts", "megadecode.backends.fused.kernels.grouped_experts")
GE = import_interpreted("megadecode.backends.fused.kernels.grouped_experts")

from megadecode import Engine  # noqa: E402
from megadecode import plan as P  # noqa: E402
from megadecode.backends.torch.ops import OP_IMPLS, StepContext  # noqa: E402
from megadecode.presets import preset_config  # noqa: E402
from megadecode.reference.routing import route  # noqa: E402
from megadecode.step import Step  # noqa: E402
from megadecode.weights import random_weights  # noqa: E402

TRITON_OK, needs_triton = triton_gate(FE.experts_up_kernel)
CFG = preset_config("tiny-k3")
PROMPTS = [[256, 72, 101, 108, 108, 111, 33], [256, 7], [256, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
MOE_LAYERS = sum(CFG.moe_layers)



@pytest.fixture(scope="module")
def weights():
    return random_weights(CFG, DEVICE, torch.float32, seed=1)


def _counting(monkeypatch, mod, name):
    calls = []
    real = getattr(mod, name)

    def counting(*a, **kw):
        calls.append(a[0].shape[0])
        return real(*a, **kw)
    monkeypatch.setattr(mod, name, counting)
    return calls


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts the fused kernel's calls (routed_experts looks it up on the module at each call)."""
    return _counting(monkeypatch, FE, "fused_experts")


@pytest.fixture
def grouped_calls(monkeypatch):
    return _counting(monkeypatch, GE, "grouped_experts")


def _greedy(weights, executor, steps=12):
    e = Engine(CFG, weights, executor=executor, max_batch=4, max_seq_len=32)
    logits = [e.prefill(PROMPTS)]
    toks = [logits[-1].argmax(-1)]
    for _ in range(steps):
        logits.append(e.decode(toks[-1]).clone())
        toks.append(logits[-1].argmax(-1))
    return torch.stack(toks, 1), torch.stack(logits, 1)


@needs_triton
def test_graph_decode_matches_torch_over_12_steps(weights, fused_calls, grouped_calls):
    tok_t, log_t = _greedy(weights, "torch")
    assert fused_calls == []  # the torch executor stays the reference loop
    tok_g, log_g = _greedy(weights, "graph")
    # prefill keeps the reference loop; every decode step's LatentMoE layers take the fused kernel (on the
    # GPU the Python call happens at capture: 2 warm-up runs + the captured one per (batch, cache bucket))
    # (on the GPU, MXFP4 scales in FAST_SCALES send small batches to the tensor-core kernels instead)
    calls = fused_calls + grouped_calls if ON_GPU else fused_calls
    assert calls == ([len(PROMPTS)] * (3 * MOE_LAYERS) if ON_GPU else [len(PROMPTS)] * (12 * MOE_LAYERS))
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
def test_graph_latent_op_equals_reference_op(weights, fused_calls, grouped_calls):
    got, want = _latent_op_pair(weights, 5)
    assert (fused_calls + grouped_calls if ON_GPU else fused_calls) == [5]
    err = (got - want).abs().max().item()
    assert err <= 1e-5 * want.abs().max().item(), err


@needs_triton
@pytest.mark.parametrize("T", [17, 40])
def test_over_16_tokens_takes_the_grouped_kernels(weights, fused_calls, grouped_calls, T):
    got, want = _latent_op_pair(weights, T, seed=T)
    assert fused_calls == [] and grouped_calls == [T]
    err = (got - want).abs().max().item()
    assert err <= 1e-5 * want.abs().max().item(), err


@needs_triton
def test_graph_decode_batch_20_matches_torch(weights, grouped_calls):
    """A ragged batch of 20 sequences (above the fused kernels' 16): every decode step's LatentMoE layers
    take the grouped kernels and the greedy tokens match the torch executor's."""
    prompts = [[256] + list(range(1 + i, 4 + i % 5 + i)) for i in range(20)]
    toks = {}
    for ex in ("torch", "graph"):
        e = Engine(CFG, weights, executor=ex, max_batch=20, max_seq_len=32)
        out, logits = [e.prefill(prompts).argmax(-1)], []
        for _ in range(4):
            logits.append(e.decode(out[-1]).clone())
            out.append(logits[-1].argmax(-1))
        toks[ex] = (torch.stack(out, 1), torch.stack(logits, 1))
    assert grouped_calls == [20] * ((3 if ON_GPU else 4) * MOE_LAYERS)  # GPU: called at capture only
    assert torch.equal(toks["graph"][0], toks["torch"][0])
    err = (toks["graph"][1] - toks["torch"][1]).abs().max().item()
    assert err <= 1e-4 * toks["torch"][1].abs().max().item(), err

