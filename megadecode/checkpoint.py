"""HF-format safetensors checkpoints: load through the weight table, and write random ones."""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import ModelConfig, config_from_hf, load_config
from .layouts import (
    LayoutError,
    Source,
    alternatives,
    hub_pieces,
    map_names,
    sibling_name,
)
from .parallel.experts import ExpertShard
from .presets import preset_hf_config
from .quant.fp8 import FP8, SCALE_DTYPES, dequantize_fp8, quantize_fp8
from .parallel.vocab import VocabShard, pad_rows, shard_rows
from .weights import (
    WeightProgress,
    mtp_generator,
    mtp_specs,
    param_specs,
    random_experts,
    random_tensor,
    vocab_shard,
)

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class CheckpointError(ValueError):
    """A checkpoint that does not match its config, with the tensor that is wrong."""


class UnknownTensorsWarning(UserWarning):
    """Tensors in a checkpoint that the model does not use, loaded anyway on request (ignore_unknown)."""


def _open(f: Path):
    try:
        return safe_open(str(f), "pt")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read safetensors file {f}: {e}") from None


def _index_files(ckpt: Path) -> dict[str, Path]:
    """Map every tensor name in the checkpoint to its file (single file or sharded with an index)."""
    if not ckpt.is_dir():
        raise CheckpointError(f"checkpoint {ckpt} is not a directory")
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {type(e).__name__}: {e}") from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard files")
        out = {}
        for name, fname in weight_map.items():
            if not isinstance(fname, str):
                raise CheckpointError(f"{index} names {fname!r} as the shard of {name!r}; expected a file name")
            f = ckpt / fname
            if not f.is_file():
                raise CheckpointError(f"{index} names shard {fname!r} for {name!r}, but {f} does not exist")
            out[name] = f
        return out
    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {ckpt}")
    out = {}
    for f in files:
        with _open(f) as h:
            for name in h.keys():
                if name in out:
                    raise CheckpointError(f"tensor {name!r} is in both {out[name].name} and {f.name}")
                out[name] = f
    return out


def _expected_extra(name: str, cfg: ModelConfig, mtp: bool = False) -> bool:
    """Tensors a checkpoint of the family may hold that are not read: DeepSeek-V3's multi-token-prediction layers
    (indices num_hidden_layers .. + num_nextn_predict_layers - 1), unless `mtp` (the MTP drafter's load: then only
    the MTP layer's copy of the embedding, `model.layers.{L}.embed_tokens`, the model's own being read), rotary
    `inv_freq` buffers of older exports, lm_head when the embedding is tied."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    L = cfg.num_layers
    if m and L <= int(m.group(1)) < L + cfg.num_mtp_layers:
        return not mtp or name == f"model.layers.{L}.embed_tokens.weight"
    return name.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and name == "lm_head.weight")


def _scale_target(name: str, specs: dict, cfg: ModelConfig) -> bool:
    """Whether our name `name` is the FP8 weight_scale_inv of a weight dequantized at load (any weight but the
    routed experts, whose scales are weights of their own)."""
    base = name[:-len("_scale_inv")] if name.endswith(".weight_scale_inv") else None
    return cfg.expert_quant == "fp8" and base in specs and specs[base].quant is None


def _check_unknown(ckpt: Path, cfg: ModelConfig, sources: dict[str, Source], specs: dict, missing: bool,
                   ignore_unknown: bool) -> None:
    """A tensor that no weight of the model reads is an error, as in vLLM's loader ("no module or parameter
    named ..."): it usually means weights of another model or variant under this config.json, and loading the
    rest would run a different model than the file describes. `ignore_unknown` turns it into a warning. Left to
    the missing-tensor error when a tensor the model needs is missing too (a wrong config names that one)."""
    unknown = []
    for target, src in sources.items():
        if target in specs:
            unknown += [n for (e, _), n in src.pieces.items() if e is not None and e >= cfg.num_experts]
        elif not _scale_target(target, specs, cfg):
            unknown += src.pieces.values()
    if not unknown or missing:
        return
    unknown.sort()
    msg = (f"checkpoint {ckpt} holds {len(unknown)} tensor{'s' if len(unknown) > 1 else ''} that a "
           f"{cfg.family} model with this config.json does not use: {', '.join(map(repr, unknown[:3]))}"
           f"{f' and {len(unknown) - 3} more' if len(unknown) > 3 else ''}")
    if not ignore_unknown:
        raise CheckpointError(f"{msg} (is config.json the one these weights were saved with? to load the "
                              f"checkpoint anyway, pass --ignore-unknown-tensors / ignore_unknown=True)")
    warnings.warn(f"{msg}; they are ignored", UnknownTensorsWarning, stacklevel=3)


class _Reader:
    """Reads checkpoint tensors by name, checking each one's dtype (and values, with check_finite)."""

    def __init__(self, where: dict[str, Path], check_finite: bool):
        self.where, self.check_finite, self.handles = where, check_finite, {}

    def _handle(self, name: str):
        f = self.where[name]
        if f not in self.handles:
            self.handles[f] = _open(f)
        return f, self.handles[f]

    def shape(self, name: str) -> tuple[int, ...]:
        f, h = self._handle(name)
        try:
            return tuple(h.get_slice(name).get_shape())
        except SafetensorError as e:
            raise CheckpointError(f"cannot read tensor {name!r} from {f.name} (the index names that file): "
                                  f"{e}") from None

    def __call__(self, name: str, kind: str | None, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """kind: None (a float weight; FP8 values are returned as they are, for the caller to dequantize),
        "mxfp4", "fp8", "fp8_scale" (ParamSpec.quant). rows (lo, hi): read only those rows of the first dim
        (a rank's experts of a stacked tensor; safetensors reads the slice alone)."""
        f, h = self._handle(name)
        try:
            t = h.get_tensor(name) if rows is None else h.get_slice(name)[rows[0]:rows[1]]
        except SafetensorError as e:
            raise CheckpointError(f"cannot read tensor {name!r} from {f.name} (the index names that file): "
                                  f"{e}") from None
        if kind == "mxfp4":  # MXFP4 packed codes / e8m0 scales: bytes, kept as they are
            if t.dtype != torch.uint8:
                raise CheckpointError(f"tensor {name!r} has dtype {t.dtype}; expected uint8 (MXFP4 "
                                      f"{'e8m0 scales' if name.endswith('weight_scale') else 'packed e2m1 codes'})")
            if self.check_finite and name.endswith("weight_scale") and bool((t == 255).any()):
                raise CheckpointError(f"tensor {name!r} holds the e8m0 NaN scale byte 255")
            return t
        if kind == "fp8" and t.dtype != FP8:
            raise CheckpointError(f"tensor {name!r} has dtype {t.dtype}; expected float8_e4m3fn (config.json's "
                                  f"quantization_config is FP8: the routed experts are kept in FP8)")
        if kind == "fp8_scale":
            if t.dtype not in SCALE_DTYPES:
                raise CheckpointError(f"tensor {name!r} has dtype {t.dtype}; expected a float FP8 block scale")
            t = t.float()
        if kind is None and t.dtype not in (*_FLOAT_DTYPES, FP8):
            raise CheckpointError(f"tensor {name!r} has dtype {t.dtype}; expected a floating dtype "
                                  f"(float32, float16 or bfloat16, or float8_e4m3fn with FP8 quantization)")
        if self.check_finite and not torch.isfinite(t.float() if t.dtype == FP8 else t).all():
            raise CheckpointError(f"tensor {name!r} contains NaN or inf values")
        return t


def _missing(ckpt: Path, cfg: ModelConfig, name: str, spec) -> CheckpointError:
    alt = [a for a in alternatives(cfg, name) if a != name]
    also = f"; looked for it as {', '.join(map(repr, alt))} too" if alt else ""
    return CheckpointError(f"checkpoint {ckpt} is missing tensor {name!r} (shape {list(spec.shape)}{also})")


def _lm_head_rows(ckpt: Path, cfg: ModelConfig, spec, src: Source, read, reader: _Reader,
                  v: VocabShard) -> torch.Tensor:
    """A rank's rows of the lm_head (vocab-parallel, parallel/vocab.py), padded to spec's shape: a single stored
    tensor is read as a slice of those rows alone; one in parts, or in FP8 (whose block scales span the rows), is
    assembled whole and sliced."""
    whole = replace(spec, shape=(cfg.vocab_size, *spec.shape[1:]))
    if src.parts == 1 and list(src.pieces) == [(None, 0)]:
        piece = src.pieces[(None, 0)]
        shape = reader.shape(piece)
        if tuple(shape) != whole.shape:
            raise CheckpointError(f"tensor {piece!r} has shape {list(shape)}, expected {list(whole.shape)}")
        t = reader(piece, None, (v.lo, v.hi))
        if t.dtype != FP8:
            return pad_rows(t, v)
    return shard_rows(_assemble(ckpt, cfg, "lm_head.weight", whole, src, read, reader, None), v)


def _assemble(ckpt: Path, cfg: ModelConfig, name: str, spec, src: Source, read, reader: _Reader,
              shard: ExpertShard | None) -> torch.Tensor:
    """Our tensor `name` from its pieces: as stored, stacked over experts, and/or concatenated along dim 0. Stacked
    experts with a `shard`: the rank's experts only, and only their pieces (or rows) are read."""
    lo, hi = (0, cfg.num_experts) if shard is None else (shard.lo, shard.hi)
    if spec.stacked and (None, 0) in src.pieces:
        if len(src.pieces) > 1:
            other = next(n for k, n in src.pieces.items() if k != (None, 0))
            raise CheckpointError(f"checkpoint {ckpt} holds both the stacked {name!r} and per-expert tensors for "
                                  f"it ({other!r}): one layout per tensor")
        piece = src.pieces[(None, 0)]
        if shard is None:
            return read(piece)
        full = reader.shape(piece)
        if not full or full[0] != cfg.num_experts:
            raise CheckpointError(f"tensor {piece!r} has shape {list(full)}, expected {cfg.num_experts} experts "
                                  f"first (num_experts in config.json)")
        return read(piece, (lo, hi))
    experts = range(lo, hi) if spec.stacked else (None,)
    keys = [(e, p) for e in experts for p in range(src.parts)]
    gone = [k for k in keys if k not in src.pieces]
    if gone:
        first = sibling_name(cfg, src, gone[0]) or name
        what = "expert tensors" if spec.stacked else "parts"
        whose = "" if shard is None or shard.world == 1 else \
            f" (rank {shard.rank} of {shard.world} holds experts {lo}..{hi - 1})"
        raise CheckpointError(f"checkpoint {ckpt} is missing {len(gone)} {what} for {name!r}{whose}, first "
                              f"{first!r}")
    lead = 1 if spec.stacked else 0
    want = (spec.shape[lead] // src.parts, *spec.shape[lead + 1:])
    got = {}
    for k in keys:
        t = read(src.pieces[k])
        if tuple(t.shape) != want:
            raise CheckpointError(f"tensor {src.pieces[k]!r} has shape {list(t.shape)}, expected {list(want)}")
        got[k] = t
    cat = [torch.cat([got[(e, p)] for p in range(src.parts)]) for e in experts]
    return torch.stack(cat) if spec.stacked else cat[0]


def load_weights(ckpt: str | Path, cfg: ModelConfig | None = None, *, device="cpu", dtype=torch.float32,
                 check_finite: bool = False, ignore_unknown: bool = False, shard: ExpertShard | None = None,
                 progress=None, mtp: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load every tensor the weight table expects, checking names, shapes and dtypes.

    Tensor names may follow any layout of the family that real checkpoints use (megadecode/layouts.py: the
    hub's, transformers' save_pretrained's, transformers' own stacked one). A tensor the model does not use is
    an error naming it (`_check_unknown`), a warning with `ignore_unknown`; those a checkpoint of the family is
    expected to carry (DeepSeek's multi-token-prediction layers, `_expected_extra`) are skipped. FP8 checkpoints
    (quantization_config fp8): the routed experts stay FP8 (values + fp32 block scales), every other FP8 weight
    is dequantized here (quant/fp8.py) and cast to `dtype`. With `check_finite`, NaN/inf is an error naming the
    tensor. With `shard` (expert parallelism) the stacked routed experts hold the rank's experts only, and no other
    expert's tensor is read (per-expert tensors: not opened; stacked ones: their rows sliced lazily); an untied
    lm_head holds the rank's rows (parallel/vocab.py), read as a slice. `progress(bytes, total bytes)`: called as
    each tensor is loaded (weights.WeightProgress). `mtp` (the MTP drafter's load): the MTP layer's tensors too,
    by name (weights.mtp_specs, read as the model's are; its `shared_head.head` only where the checkpoint holds it);
    without it they are skipped and never read.
    """
    ckpt = Path(ckpt)
    cfg = cfg or load_config(ckpt)
    if mtp and shard is not None:
        raise ValueError("the MTP layer's weights are loaded in one process (no expert parallelism)")
    where = _index_files(ckpt)
    mtp_layer = f"model.layers.{cfg.num_layers}."
    if mtp and cfg.num_mtp_layers and not any(n.startswith(mtp_layer) for n in where):
        raise CheckpointError(f"checkpoint {ckpt} holds no MTP layer ({mtp_layer}* tensors), though its config.json "
                              f"declares {cfg.num_mtp_layers} (num_nextn_predict_layers; transformers' "
                              f"save_pretrained writes 1 without saving one)")
    try:
        sources = map_names(cfg, [n for n in where if not _expected_extra(n, cfg, mtp)])
    except LayoutError as e:
        raise CheckpointError(f"checkpoint {ckpt}: {e}") from None
    if cfg.expert_quant != "fp8":
        scale = next((n for n in where if n.endswith(".weight_scale_inv")), None)
        if scale is not None:
            raise CheckpointError(f"checkpoint {ckpt} holds FP8 weights ({scale!r}), but config.json has no FP8 "
                                  f"quantization_config (quant_method 'fp8' with weight_block_size)")
    specs = param_specs(cfg, shard)
    if mtp:
        specs.update({n: sp for n, sp in mtp_specs(cfg).items()
                      if n in sources or not n.endswith(".shared_head.head.weight")})
    missing = [n for n in specs if n not in sources]
    _check_unknown(ckpt, cfg, sources, specs, bool(missing), ignore_unknown)
    if missing:
        raise _missing(ckpt, cfg, missing[0], specs[missing[0]])
    reader = _Reader(where, check_finite)
    used_scales = set()

    def read_float(spec_name: str):
        """Pieces of a weight held in the model dtype: FP8 ones dequantized with their weight_scale_inv."""
        scales = sources.get(spec_name + "_scale_inv")

        def read(piece: str, rows=None) -> torch.Tensor:
            t = reader(piece, None, rows)
            if t.dtype != FP8:
                return t
            key = next(k for k, n in sources[spec_name].pieces.items() if n == piece)
            if cfg.expert_quant != "fp8":
                raise CheckpointError(f"tensor {piece!r} is float8_e4m3fn, but config.json has no FP8 "
                                      f"quantization_config (weight_block_size) to dequantize it with")
            if scales is None or key not in scales.pieces:
                raise CheckpointError(f"tensor {piece!r} is float8_e4m3fn, but the checkpoint has no "
                                      f"{piece.removesuffix('weight') + 'weight_scale_inv'!r} for it")
            s = reader(scales.pieces[key], "fp8_scale")
            used_scales.add(scales.pieces[key])
            try:
                return dequantize_fp8(t, s, cfg.weight_block)
            except ValueError as e:
                raise CheckpointError(f"tensor {piece!r}: {e}") from None
        return read

    weights = {}
    vshard = vocab_shard(cfg, shard)
    tick = WeightProgress(cfg, dtype, shard, progress)
    for name, spec in specs.items():
        read = (lambda n, rows=None, q=spec.quant: reader(n, q, rows)) if spec.quant else read_float(name)
        if name == "lm_head.weight" and vshard is not None:
            t = _lm_head_rows(ckpt, cfg, spec, sources[name], read, reader, vshard)
        else:
            t = _assemble(ckpt, cfg, name, spec, sources[name], read, reader, shard)
        if tuple(t.shape) != spec.shape:
            raise CheckpointError(f"tensor {name!r} has shape {list(t.shape)}, expected {list(spec.shape)}")
        if spec.quant:
            weights[name] = t.to(device=device)
            tick(name)
            continue
        t = t.to(device=device, dtype=torch.float32 if spec.fp32 else dtype)
        if check_finite and not torch.isfinite(t).all():  # finite in the file, not after the cast
            raise CheckpointError(f"tensor {name!r} overflows {t.dtype} (values beyond its range)")
        weights[name] = t
        tick(name)
    stray = sorted(n for t, src in sources.items() if _scale_target(t, specs, cfg) for n in src.pieces.values()
                   if n not in used_scales)
    if stray:
        raise CheckpointError(f"checkpoint {ckpt} holds {stray[0]!r}, the FP8 scale of a weight that is not "
                              f"stored in FP8")
    return cfg, weights


def _prepare_out_dir(out: Path, overwrite: bool) -> None:
    """`out` becomes an empty directory, or a directory whose checkpoint files (config.json, safetensors, index)
    are replaced with `overwrite`; never a file, never another model's directory silently."""
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"cannot write a checkpoint to {out}: it exists and is not a directory")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held:
        if not overwrite:
            raise CheckpointError(f"{out} is not empty (it holds {', '.join(held[:3])}{', ...' if len(held) > 3 else ''}"
                                  f"); choose a new or empty directory, or pass --overwrite (overwrite=True) to "
                                  f"replace the checkpoint in it")
        for f in [*out.glob("*.safetensors"), out / "model.safetensors.index.json"]:
            f.unlink(missing_ok=True)  # no stale shard of the old checkpoint stays beside the new one
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create the checkpoint directory {out}: {e}") from None


def _fp8_in_checkpoint(name: str, spec) -> bool:
    """Which weights an FP8 checkpoint stores in FP8, as DeepSeek-V3's do: every linear of attention and MLP
    (routed experts included), not the router, the norms, the embedding or lm_head."""
    return (spec.quant == "fp8" or spec.init == "linear" and len(spec.shape) == 2
            and (".self_attn." in name or ".mlp." in name) and not name.endswith(".mlp.gate.weight"))


def _split(t: torch.Tensor):
    """parts_by_piece for layouts.hub_pieces: our tensor cut into (expert or None, part) pieces."""
    def cut(parts: int, stacked: bool) -> dict:
        if not stacked:
            return {(None, p): c for p, c in enumerate(t.chunk(parts, 0))}
        return {(e, p): c for e in range(t.shape[0]) for p, c in enumerate(t[e].chunk(parts, 0))}
    return cut


def make_checkpoint(out_dir: str | Path, preset_or_hf: str | dict, *, seed: int = 0, dtype=torch.bfloat16,
                    shard_bytes: int = 2 << 30, overwrite: bool = False) -> Path:
    """Write a random-weight HF-format checkpoint (config.json + sharded safetensors + index) into a new or empty
    directory (`overwrite`: replace the checkpoint files of a non-empty one).

    Tensors are named as the family's hub checkpoints name them (layouts.py, spelling "hub": experts per
    expert, Kimi-Linear's `block_sparse_moe` and separate q/k/v convs; kimi_k3: MXFP4 experts as
    compressed-tensors `weight_packed` / `weight_scale` uint8 pairs, `random_tensor`'s bytes). An FP8 config
    (quantization_config fp8) gets FP8 weights as DeepSeek-V3's checkpoints hold them (`_fp8_in_checkpoint`):
    the routed experts as drawn (`random_tensor`), the other linears drawn in `dtype` and quantized
    (quant/fp8.py), each with its `weight_scale_inv`.
    A model with an MTP layer (num_nextn_predict_layers) gets its tensors too (weights.mtp_specs, the values of
    random_weights(mtp=True)), named as DeepSeek-V3's checkpoints name them.
    """
    hf = preset_hf_config(preset_or_hf) if isinstance(preset_or_hf, str) else dict(preset_or_hf)
    cfg = config_from_hf(hf)
    out = Path(out_dir)
    _prepare_out_dir(out, overwrite)
    hf.setdefault("torch_dtype", str(dtype).removeprefix("torch."))
    if cfg.expert_quant == "mxfp4":  # say so, as a compressed-tensors checkpoint does
        hf.setdefault("quantization_config", {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"})
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    gen, mtp_gen = torch.Generator().manual_seed(seed), mtp_generator(seed)
    tables = [(n, sp, gen) for n, sp in param_specs(cfg).items()]
    tables += [(n, sp, mtp_gen) for n, sp in mtp_specs(cfg).items()]
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, spec, g in tables:  # the values of weights.random_weights (with mtp)
        t = random_experts(spec, g, "cpu", dtype) if spec.stacked else random_tensor(spec, g, "cpu", dtype)
        tensors = {name: t}
        if cfg.expert_quant == "fp8" and _fp8_in_checkpoint(name, spec) and spec.quant is None:
            tensors = dict(zip((name, name + "_scale_inv"), quantize_fp8(t, cfg.weight_block)))
        for our, tt in tensors.items():
            for n, c in hub_pieces(cfg, our, _split(tt)).items():
                c = c.contiguous()
                if size and size + c.numel() * c.element_size() > shard_bytes:
                    shards.append({})
                    size = 0
                shards[-1][n] = c
                size += c.numel() * c.element_size()
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": sum(t.numel() * t.element_size() for s in shards
                                                   for t in s.values())},
                    "weight_map": weight_map}, indent=2))
    return out
