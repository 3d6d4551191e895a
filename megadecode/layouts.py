"""Checkpoint tensor names -> the weight table's names (weights.py), as data: one table of rules per family.

A rule says that the checkpoint tensors matching `source` make up part `part` of `parts` (concatenated along the
first weight dim, per expert when stacked) of our tensor `target`. Templates use {layer} (`model.layers.<i>`),
{e} (an expert index: the pieces are stacked over experts in index order), {kind} (the tensor kind of a linear:
`weight`, FP8's `weight_scale_inv`, compressed-tensors' `weight_packed` / `weight_scale`) and {rest} (any
suffix). A name no rule matches is ours as it is; the first matching rule wins. Rules of one checkpoint layout
share a `spelling`, which names a missing piece the way its siblings are spelled.

Layouts (tensor names of transformers 5.17.0 and 5.24.0, the pinned oracle and the newest 5.x at the time:
their `conversion_mapping.py` and what `save_pretrained` writes, checked on tiny models of each family;
the hub's by its released modeling code):
  qwen3_moe, deepseek_v3 / kimi_k2
    hub and save_pretrained  experts per expert: `mlp.experts.{e}.gate_proj|up_proj|down_proj.{kind}`
    transformers' own        experts stacked: `mlp.experts.gate_up_proj` [E, 2I, D] (gate rows first),
                             `mlp.experts.down_proj` [E, D, I] (save_pretrained(save_original_format=False))
  kimi_linear
    hub (moonshotai)         MoE layers under `block_sparse_moe.` (gate, shared_experts, experts.{e}.w1|w3|w2:
                             gate, up, down), dense layers under `mlp.`; KDA `self_attn.q_conv1d|k_conv1d|
                             v_conv1d.weight` [H*K, 1, k] and `self_attn.f_a_proj|f_b_proj|dt_bias|A_log`
    save_pretrained          the hub's names, except that the dense layers too are under `block_sparse_moe.`
    transformers' own        `mlp.` everywhere, `self_attn.conv1d.weight` [3*H*K, 1, k] (q, k, v channels),
                             `self_attn.forget_gate.*`, experts stacked as above or per expert `mlp.experts.{e}.w1`
  kimi_k3 (megadecode/k3.md)  experts per expert `mlp.experts.{e}.gate_proj|up_proj|down_proj.weight_packed|
                             weight_scale` (compressed-tensors MXFP4), or stacked under our names
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .config import ModelConfig

# {kind} of a linear in a checkpoint -> the suffix of our stacked expert tensors
KIND_SUFFIX = {"weight": "", "weight_scale_inv": "_scale_inv", "weight_packed": ".weight_packed",
               "weight_scale": ".weight_scale"}
_PLACEHOLDERS = {"layer": r"model\.layers\.\d+", "e": r"\d+", "kind": "|".join(sorted(KIND_SUFFIX, key=len)[::-1]),
                 "rest": r".+"}


def _regex(template: str, groups: dict[str, str]) -> re.Pattern:
    out, pos = [], 0
    for m in re.finditer(r"\{(\w+)\}", template):
        out.append(re.escape(template[pos:m.start()]))
        out.append(f"(?P<{m.group(1)}>{groups[m.group(1)]})")
        pos = m.end()
    return re.compile("^" + "".join(out) + re.escape(template[pos:]) + "$")


@dataclass(frozen=True)
class Rule:
    source: str  # checkpoint name template
    target: str  # our name template
    part: int = 0
    parts: int = 1
    spelling: str = ""
    _src: re.Pattern = field(init=False, repr=False, compare=False)
    _tgt: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "_src", _regex(self.source, _PLACEHOLDERS))
        # our names hold {kind} as its suffix (KIND_SUFFIX), the rest as in the source
        tgt = {**_PLACEHOLDERS, "kind": "|".join(re.escape(s) for s in sorted(KIND_SUFFIX.values(), key=len)[::-1])}
        object.__setattr__(self, "_tgt", _regex(self.target, tgt))

    @property
    def stacked(self) -> bool:
        return "{e}" in self.source

    def match(self, name: str) -> dict | None:
        m = self._src.match(name)
        return None if m is None else m.groupdict()

    def target_of(self, g: dict) -> str:
        return self.target.format(**{**g, "kind": KIND_SUFFIX.get(g.get("kind"), "")})

    def source_of(self, g: dict) -> str:
        return self.source.format(**g)

    def match_target(self, name: str) -> dict | None:
        """The groups of one of our names under this rule (kind as the checkpoint spells it), or None."""
        m = self._tgt.match(name)
        if m is None:
            return None
        g = m.groupdict()
        if "kind" in g:
            g["kind"] = next(k for k, s in KIND_SUFFIX.items() if s == g["kind"])
        return g


def experts(source: str, projs: tuple[str, str, str], spelling: str) -> tuple[Rule, ...]:
    """Per-expert tensors of (gate, up, down), `source` with {proj}: gate and up are parts 0 and 1 of
    `{layer}.mlp.experts.gate_up_proj`, down is `{layer}.mlp.experts.down_proj`."""
    gate, up, down = projs
    t = "{layer}.mlp.experts."
    return (Rule(source.replace("{proj}", gate), t + "gate_up_proj{kind}", 0, 2, spelling),
            Rule(source.replace("{proj}", up), t + "gate_up_proj{kind}", 1, 2, spelling),
            Rule(source.replace("{proj}", down), t + "down_proj{kind}", 0, 1, spelling))


_HF_EXPERTS = experts("{layer}.mlp.experts.{e}.{proj}.{kind}", ("gate_proj", "up_proj", "down_proj"), "hub")
_KDA_HUB = (
    *(Rule(f"{{layer}}.self_attn.{x}_conv1d.weight", "{layer}.self_attn.conv1d.weight", j, 3, "hub")
      for j, x in enumerate("qkv")),
    *(Rule(f"{{layer}}.self_attn.{x}", f"{{layer}}.self_attn.forget_gate.{x}", spelling="hub")
      for x in ("f_a_proj.{rest}", "f_b_proj.{rest}", "dt_bias", "A_log")),  # rest: weight (+ FP8 weight_scale_inv)
)
LAYOUTS: dict[str, tuple[Rule, ...]] = {
    "qwen3_moe": _HF_EXPERTS,
    "deepseek_v3": _HF_EXPERTS,
    "kimi_k3": _HF_EXPERTS,
    "kimi_linear": (
        *experts("{layer}.block_sparse_moe.experts.{e}.{proj}.{kind}", ("w1", "w3", "w2"), "hub"),
        *experts("{layer}.mlp.experts.{e}.{proj}.{kind}", ("w1", "w3", "w2"), "transformers"),
        Rule("{layer}.block_sparse_moe.gate.{rest}", "{layer}.mlp.gate.{rest}", spelling="hub"),
        Rule("{layer}.block_sparse_moe.shared_experts.{rest}", "{layer}.mlp.shared_experts.{rest}", spelling="hub"),
        # save_pretrained renames every `.mlp.` back to `.block_sparse_moe.`, the dense layers' too
        Rule("{layer}.block_sparse_moe.{rest}", "{layer}.mlp.{rest}", spelling="save_pretrained"),
        *_KDA_HUB,
    ),
}


@dataclass
class Source:
    """Where one of our tensors comes from: pieces[(expert or None, part)] = checkpoint name."""
    parts: int = 1
    pieces: dict[tuple[int | None, int], str] = field(default_factory=dict)
    rules: dict[str, Rule] = field(default_factory=dict)  # checkpoint name -> the rule that mapped it
    groups: dict[str, dict] = field(default_factory=dict)  # checkpoint name -> its template groups


class LayoutError(ValueError):
    """Two checkpoint tensors that give the same piece of one of our tensors."""


def map_names(cfg: ModelConfig, names) -> dict[str, Source]:
    """Our tensor name -> its Source, for every checkpoint name (those no rule matches map to themselves)."""
    rules = LAYOUTS.get(cfg.family, ())
    out: dict[str, Source] = {}
    for n in names:
        rule, g = next(((r, g) for r in rules if (g := r.match(n)) is not None), (None, None))
        if rule is None:
            target, key, parts = n, (None, 0), 1
        else:
            target, parts = rule.target_of(g), rule.parts
            key = (int(g["e"]) if rule.stacked else None, rule.part)
        src = out.setdefault(target, Source(parts))
        if key in src.pieces:
            raise LayoutError(f"checkpoint tensors {src.pieces[key]!r} and {n!r} both give "
                              f"{_piece(target, key, parts)}")
        src.pieces[key] = n
        if rule is not None:
            src.rules[n], src.groups[n] = rule, g
    return out


def _piece(target: str, key: tuple[int | None, int], parts: int) -> str:
    e, part = key
    where = "" if e is None else f"expert {e} of "
    return f"{where}{target!r}" + (f" (part {part} of {parts})" if parts > 1 else "")


def sibling_name(cfg: ModelConfig, src: Source, key: tuple[int | None, int]) -> str | None:
    """The checkpoint name of a missing piece, spelled as the pieces present are."""
    if not src.rules:
        return None
    n = next(iter(src.rules))
    rule, g = src.rules[n], src.groups[n]
    for r in LAYOUTS[cfg.family]:
        if r.spelling == rule.spelling and r.target == rule.target and r.part == key[1]:
            return r.source_of({**g, "e": key[0]})
    return None


def alternatives(cfg: ModelConfig, name: str) -> list[str]:
    """Checkpoint names (expert 0 for stacked tensors) that the family's rules would read as our `name`."""
    out = []
    for r in LAYOUTS.get(cfg.family, ()):
        g = r.match_target(name)
        if g is not None:
            out.append(r.source_of({**g, "e": 0}))
    return out


def hub_pieces(cfg: ModelConfig, name: str, parts_by_piece) -> dict[str, object]:
    """Our tensor `name` split the way the family's hub checkpoints hold it: {checkpoint name: piece}, where
    parts_by_piece(parts, stacked) -> {(expert or None, part): tensor} cuts the tensor (the caller's)."""
    hub = [r for r in LAYOUTS.get(cfg.family, ()) if r.spelling == "hub" and r.match_target(name) is not None]
    if not hub:
        return {name: parts_by_piece(1, False)[(None, 0)]}
    pieces = parts_by_piece(hub[0].parts, hub[0].stacked)
    out = {}
    for (e, part), t in pieces.items():
        r = next(r for r in hub if r.part == part)
        out[r.source_of({**r.match_target(name), "e": e})] = t
    return out
