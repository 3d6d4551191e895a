"""Cases that leave the easy corner: shapes derived from a tiny preset and the variant's Scope, added to the
matrix's base cases (the preset itself over the batch sweep).

The tiny presets have power-of-two dims (hidden 64, heads of 16, 8 or 16 experts), a cache shorter than one
attention block, slots 0..T-1 and well-scaled rows, so a wrong mask on a partial last tile, a broken
split-over-cache merge, a slot indirection bug or an eps / precision mistake never shows there. Per (preset, op
kind) the candidates are:
  odd-dims      the preset with non-power-of-two dims that keep every constraint the kernels check (hidden 80,
                expert intermediate 48 (96 for MXFP4: multiples of 32), 12 experts, head dims 24, latent 96, MLA
                ranks 48): partial last tiles in every tiled dimension; batches 3 and 17
  tile-edge     batches just past the kernels' row tiles (TILE_EDGES: 16-row MMA tiles, 64-token lm_head and
                RMSNorm tiles, 128 and 192), those inside the scope's batch range
  edge          each Scope.limits dimension at its upper bound (and all of them at once), where the config stays
                valid: hidden 16384 for the norms, 1024 experts in 16 groups for the router; batch 2
  long-cache    attention: LONG_CACHE positions (several 32-position blocks: the split plan cuts the cache in
                chunks and the merge runs; on the CPU, whose split plan assumes 2 SMs, at batch 1 for GQA and MLA
                and at batch 2 for MLA; on the H200 at every batch of the sweep); batches 1 and 2
  slots         attention and KDA: a random permutation of batch + 3 slots (slot indirection, unused slots);
                batches 3 and 8, and with a long cache at batch 1
  sources       AttnRes: ops over SOURCES sources (closed blocks + the partial sum), off the power-of-two corner
                of the tiny preset's op (2 sources; the kernel pads its score vector to a power of two), in a
                config deep enough to have them; batch 3
  magnitude     norm and residual ops and KDA: every third row tiny (1e-3) or large (4096: squares overflow
                fp16), KDA's conv and recurrent states in those rows' slots too; batch 7, at the preset's dims and
                at odd dims
Each case belongs to a family (Case.family: odd-dims, tile-edge, edge, long-cache, slots, sources,
magnitude-tiny, magnitude-large; the two magnitudes apart, as they catch different mistakes: eps placement and
precision at small norms, overflow at large ones). `sample(cands, k, seed)` keeps a sample of k when the full
product is too slow for CI: the first candidate of every family, always (a sampled run never leaves a family out,
whatever the seed), then a seeded draw of the rest up to k. The matrix reports which were run (the `case` and
`case_family` columns) and the command prints the sample and its families.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from .. import plan as P
from ..config import ConfigError, ModelConfig
from ..contract import DTYPE_NAMES
from .inputs import ATTENTION, CACHE_LEN, MAGNITUDE_KINDS

TILE_EDGES = (17, 65, 129, 193)
DTYPES_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}
LONG_CACHE = 200
# AttnRes source counts: K3's 93 layers in blocks of 12 give ops over 1 to 8 sources; these are off the powers of two
# (one, three and one padded lanes of the kernel's score vector)
SOURCES = (3, 5, 7)
ODD_BATCHES = (3, 17)


@dataclass(frozen=True)
class Case:
    name: str
    family: str
    cfg: ModelConfig
    batch: int
    cache_len: int = CACHE_LEN
    slots: str = "arange"
    magnitude: str | None = None
    sources: int | None = None

    def build_kwargs(self) -> dict:
        return {"cache_len": self.cache_len, "slots": self.slots, "magnitude": self.magnitude,
                "sources": self.sources}


def odd_config(cfg: ModelConfig) -> ModelConfig | None:
    """The preset with non-power-of-two dims (module doc); None when the family's config refuses them."""
    mx = cfg.expert_quant == "mxfp4"
    kw = {"hidden_size": 80, "moe_intermediate_size": 96 if mx else 48, "num_experts": 12}
    if not all(cfg.moe_layers):
        kw["intermediate_size"] = 112
    if cfg.is_mla:
        kw.update(kv_lora_rank=48, qk_nope_head_dim=24, v_head_dim=24)
        if cfg.q_lora_rank is not None:
            kw["q_lora_rank"] = 48
    else:
        kw["head_dim"] = 24
    if cfg.linear_head_dim:
        kw["linear_head_dim"] = 24
    if cfg.latent_size:
        kw["latent_size"] = 96
    try:
        return replace(cfg, **kw)
    except ConfigError:
        return None


def deeper_config(cfg: ModelConfig, num_layers: int) -> ModelConfig:
    """The preset with `num_layers` layers, the extra ones of its last layer's kinds (MoE or dense, KDA or not)."""
    more = num_layers - cfg.num_layers

    def extend(t: tuple) -> tuple:
        return t + t[-1:] * more if t else t
    return replace(cfg, num_layers=num_layers, moe_layers=extend(cfg.moe_layers), kda_layers=extend(cfg.kda_layers))


def sources_cases(cfg: ModelConfig) -> list[Case]:
    """AttnRes ops over each of SOURCES sources: the block-closing op at layer n * block size, whose sources are
    n closed blocks, in a config with one more layer."""
    B = cfg.attn_res_block_size
    return [Case(f"sources-{n} b3", "sources", deeper_config(cfg, max(cfg.num_layers, n * B + 1)), 3, sources=n)
            for n in SOURCES]


def edge_configs(cfg: ModelConfig, limits) -> list[tuple[str, ModelConfig]]:
    """(name, config) with each Scope.limits field at its upper bound, then all at once; a field the preset does
    not use (expert groups of an ungrouped router) keeps its value; invalid configs are left out."""
    singles = [(f, hi) for f, _, hi in limits if getattr(cfg, f) != hi and not (f == "n_group" and cfg.n_group == 1)]
    combos = [[s] for s in singles] + ([singles] if len(singles) > 1 else [])
    out = []
    for combo in combos:
        try:
            c = replace(cfg, **dict(combo))
        except ConfigError:
            continue
        out.append(("edge " + ",".join(f"{f}={v}" for f, v in combo), c))
    return out


def candidates(variant, cfg: ModelConfig, kind: str, device: str = "cpu", max_batch: int | None = None) -> list[Case]:
    """Every extra case for (variant, preset config, op kind) that the variant's scope admits on `device` (in its
    first dtype): a case out of scope is not a candidate. `max_batch`: leave out larger batches (the quick CPU
    matrix: the interpreter takes 5-20 s per cell at batch 129-193 for attention)."""
    lo, hi = variant.manifest.scope.batch
    out: list[Case] = []
    odd = odd_config(cfg)
    if odd is not None:
        out += [Case(f"odd-dims b{b}", "odd-dims", odd, b) for b in ODD_BATCHES]
    out += [Case(f"tile-edge b{b}", "tile-edge", cfg, b) for b in TILE_EDGES]
    out += [Case(f"{name} b2", "edge", c, 2) for name, c in edge_configs(cfg, variant.manifest.scope.limits)]
    if kind in ATTENTION and kind != P.ATTN_KDA:
        out += [Case(f"long-cache b{b}", "long-cache", cfg, b, cache_len=LONG_CACHE) for b in (1, 2)]
    if kind in ATTENTION:
        out += [Case(f"slots b{b}", "slots", cfg, b, slots="permuted") for b in (3, 8)]
    if kind in ATTENTION and kind != P.ATTN_KDA:
        out.append(Case("slots+long-cache b1", "slots", cfg, 1, cache_len=LONG_CACHE, slots="permuted"))
    if kind == P.ATTN_RES:
        out += sources_cases(cfg)
    if kind in MAGNITUDE_KINDS:
        for m in ("tiny", "large"):
            out.append(Case(f"magnitude-{m} b7", f"magnitude-{m}", cfg, 7, magnitude=m))
            if odd is not None:
                out.append(Case(f"magnitude-{m} odd-dims b7", f"magnitude-{m}", odd, 7,
                                 magnitude=m))
    dtype = DTYPES_BY_NAME[variant.manifest.scope.dtypes[0]]
    hi = hi if max_batch is None else min(hi, max_batch)
    return [c for c in out if lo <= c.batch <= hi and variant.supports(c.cfg, dtype, c.batch, device) is None]


def families(cands: list[Case]) -> list[str]:
    """The case families among `cands`, in candidate order."""
    return list(dict.fromkeys(c.family for c in cands))


def sample(cands: list[Case], k: int | None, seed: int, key: str = "") -> list[Case]:
    """All candidates (k None), or a sample in candidate order: the first candidate of each family (every family
    is run, whatever the seed: more than k when there are more families than k), then a draw of the others with
    (seed, key) up to k in all. The key (preset and op) makes each (preset, op) draw its own sample."""
    if k is None or k >= len(cands):
        return list(cands)
    firsts = {c.family: i for i, c in reversed(list(enumerate(cands)))}
    keep = set(firsts.values())
    rest = [i for i in range(len(cands)) if i not in keep]
    keep |= set(random.Random(f"{seed}:{key}").sample(rest, max(0, min(k - len(keep), len(rest)))))
    return [c for i, c in enumerate(cands) if i in keep]
