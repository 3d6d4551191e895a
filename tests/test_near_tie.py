"""The routing margin (reference/routing.py) is a true bound: moving every router logit by less than half of it never
changes `route`'s pick, for softmax, sigmoid with a bias, and grouped sigmoid routing; an exact tie has margin 0.
RoutingMargins (validate/near_tie.py) keeps each sequence's smallest margin through prefill and decode."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megadecode.engine import Engine
from megadecode.presets import preset_config
from megadecode.reference.routing import route, routing_margin
from megadecode.validate.near_tie import RoutingMargins
from megadecode.weights import random_weights

RULES = {
    "softmax": SimpleNamespace(top_k=3, score_func="softmax", norm_topk_prob=True, n_group=1, topk_group=1,
                               routed_scaling_factor=1.0),
    "sigmoid": SimpleNamespace(top_k=3, score_func="sigmoid", norm_topk_prob=True, n_group=1, topk_group=1,
                               routed_scaling_factor=2.5),
    "grouped": SimpleNamespace(top_k=3, score_func="sigmoid", norm_topk_prob=True, n_group=4, topk_group=2,
                               routed_scaling_factor=2.5),
}


@pytest.mark.parametrize("rule", sorted(RULES))
def test_moves_under_half_the_margin_never_change_the_pick(rule):
    cfg, E, T = RULES[rule], 16, 16
    gen = torch.Generator().manual_seed(0)
    x = torch.eye(T, E)  # logits[t, e] = gate_w[e, t]: a perturbation of gate_w moves the logits by exactly it
    for trial in range(50):
        w = torch.randn(E, E, generator=gen)
        bias = torch.randn(E, generator=gen) * 0.1 if rule != "softmax" else None
        m = routing_margin(cfg, x, w, bias)
        assert (m >= 0).all() and torch.isfinite(m).all()
        ids = route(cfg, x, w, bias)[0].sort(-1).values
        noise = (torch.rand(E, E, generator=gen) * 2 - 1) * (m[None, :] / 2) * 0.999
        moved = route(cfg, x, w + noise, bias)[0].sort(-1).values
        assert torch.equal(ids, moved), (trial, m)


def test_an_exact_tie_has_margin_zero_and_a_clear_pick_does_not():
    cfg = RULES["softmax"]
    x = torch.eye(2)
    w = torch.tensor([[3.0, 3.0], [2.0, 2.0], [1.0, 5.0], [1.0, 0.0]])  # token 0: its 3rd and 4th logits tie
    m = routing_margin(cfg, x, w, None)
    assert m[0] == 0 and m[1] == pytest.approx(2.0)


def test_routing_margins_mark_sequences_through_prefill_and_decode():
    cfg = preset_config("tiny-qwen3-moe")
    eng = Engine(cfg, random_weights(cfg, "cpu", torch.float32, seed=1), executor="torch", max_batch=3,
                 max_seq_len=32)
    margins = RoutingMargins(eng)
    tok = eng.prefill([[256, 1, 2], [256, 5], [256, 7, 8, 9]]).argmax(-1)
    after_prefill = margins.per_sequence.clone()
    assert after_prefill.shape == (3,) and margins.smallest == float(after_prefill.min()) > 0
    margins.per_sequence = torch.full((3,), float("inf"))  # forget the prefill: the decode step alone must set all
    eng.decode(tok)
    assert torch.isfinite(margins.per_sequence).all() and (margins.per_sequence > 0).all()
    assert margins.smallest <= float(margins.per_sequence.min())
    with pytest.raises(TypeError, match="torch executor"):
        RoutingMargins(Engine(cfg, random_weights(cfg, "cpu", torch.float32, seed=1), executor="pyvm",
                              max_batch=1, max_seq_len=8))
