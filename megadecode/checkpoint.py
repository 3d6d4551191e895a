"""HF-format safetensors checkpoints: load through the weight table, and write random ones."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import ModelConfig, config_from_hf, load_config
from .presets import preset_hf_config
from .weights import param_specs, random_tensor

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


def _expected_extra(name: str, cfg: ModelConfig) -> bool:
    """Tensors a checkpoint of the family may hold that the decode step does not use: DeepSeek-V3's
    multi-token-prediction layers (indices num_hidden_layers .. + num_nextn_predict_layers - 1), rotary
    `inv_freq` buffers of older exports, lm_head when the embedding is tied."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    mtp = cfg.hf.get("num_nextn_predict_layers") or 0
    if m and isinstance(mtp, int) and cfg.num_layers <= int(m.group(1)) < cfg.num_layers + mtp:
        return True
    return name.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and name == "lm_head.weight")


def _check_unknown(ckpt: Path, cfg: ModelConfig, where: dict[str, Path], ignore_unknown: bool) -> None:
    """A tensor that no weight of the model reads is an error, as in vLLM's loader ("no module or parameter
    named ..."): it usually means weights of another model or variant under this config.json, and loading the
    rest would run a different model than the file describes. `ignore_unknown` turns it into a warning. Left to
    the missing-tensor error when a tensor the model needs is missing too (a wrong config names that one)."""
    specs = param_specs(cfg)
    known = set(specs)
    for spec in specs.values():
        if spec.stacked:
            known.update(spec.hf_names(cfg.num_experts))
    unknown = sorted(n for n in where if n not in known and not _expected_extra(n, cfg))
    missing = any(name not in where and (spec.stacked is None or any(n not in where for n in
                                                                     spec.hf_names(cfg.num_experts)))
                  for name, spec in specs.items())
    if not unknown or missing:
        return
    msg = (f"checkpoint {ckpt} holds {len(unknown)} tensor{'s' if len(unknown) > 1 else ''} that a "
           f"{cfg.family} model with this config.json does not use: {', '.join(map(repr, unknown[:3]))}"
           f"{f' and {len(unknown) - 3} more' if len(unknown) > 3 else ''}")
    if not ignore_unknown:
        raise CheckpointError(f"{msg} (is config.json the one these weights were saved with? to load the "
                              f"checkpoint anyway, pass --ignore-unknown-tensors / ignore_unknown=True)")
    warnings.warn(f"{msg}; they are ignored", UnknownTensorsWarning, stacklevel=3)


def load_weights(ckpt: str | Path, cfg: ModelConfig | None = None, *, device="cpu", dtype=torch.float32,
                 check_finite: bool = False, ignore_unknown: bool = False
                 ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load every tensor the weight table expects, checking names, shapes and dtypes.

    Routed experts may be stored per expert (HF hub layout) or already stacked. A tensor the model does not
    use is an error naming it (`_check_unknown`), a warning with `ignore_unknown`; those a checkpoint of the
    family is expected to carry (DeepSeek's multi-token-prediction layers, `_expected_extra`) are skipped.
    With `check_finite`, NaN/inf is an error naming the tensor.
    """
    ckpt = Path(ckpt)
    cfg = cfg or load_config(ckpt)
    where = _index_files(ckpt)
    _check_unknown(ckpt, cfg, where, ignore_unknown)
    handles: dict[Path, object] = {}

    def read(name: str, quant: str | None = None) -> torch.Tensor:
        f = where[name]
        if f not in handles:
            handles[f] = _open(f)
        try:
            t = handles[f].get_tensor(name)
        except SafetensorError as e:
            raise CheckpointError(f"cannot read tensor {name!r} from {f.name} (the index names that file): "
                                  f"{e}") from None
        if quant:  # MXFP4 packed codes / e8m0 scales: bytes, kept as they are
            if t.dtype != torch.uint8:
                raise CheckpointError(f"tensor {name!r} has dtype {t.dtype}; expected uint8 (MXFP4 "
                                      f"{'e8m0 scales' if name.endswith('weight_scale') else 'packed e2m1 codes'})")
            if check_finite and name.endswith("weight_scale") and bool((t == 255).any()):
                raise CheckpointError(f"tensor {name!r} holds the e8m0 NaN scale byte 255")
            return t
        if t.dtype not in _FLOAT_DTYPES:
            raise CheckpointError(f"tensor {name!r} has dtype {t.dtype}; expected a floating dtype "
                                  f"(float32, float16 or bfloat16)")
        if check_finite and not torch.isfinite(t).all():
            raise CheckpointError(f"tensor {name!r} contains NaN or inf values")
        return t

    weights = {}
    for name, spec in param_specs(cfg).items():
        if name in where or spec.stacked is None:
            if name not in where:
                raise CheckpointError(f"checkpoint {ckpt} is missing tensor {name!r} (shape {list(spec.shape)})")
            t = read(name, spec.quant)
        else:
            parts = spec.hf_names(cfg.num_experts)
            missing = [n for n in parts if n not in where]
            if missing:
                raise CheckpointError(f"checkpoint {ckpt} is missing {len(missing)} expert tensors for "
                                      f"{name!r}, first {missing[0]!r}")
            step = 2 if spec.stacked == "experts_gate_up" else 1
            experts = []
            for j in range(cfg.num_experts):
                ts = [read(n, spec.quant) for n in parts[j * step:(j + 1) * step]]
                for n, t in zip(parts[j * step:(j + 1) * step], ts):
                    want = (spec.shape[1] // step, spec.shape[2])
                    if tuple(t.shape) != want:
                        raise CheckpointError(f"tensor {n!r} has shape {list(t.shape)}, expected {list(want)}")
                experts.append(torch.cat(ts, 0))
            t = torch.stack(experts)
        if tuple(t.shape) != spec.shape:
            raise CheckpointError(f"tensor {name!r} has shape {list(t.shape)}, expected {list(spec.shape)}")
        if spec.quant:
            weights[name] = t.to(device=device)
            continue
        t = t.to(device=device, dtype=torch.float32 if spec.fp32 else dtype)
        if check_finite and not torch.isfinite(t).all():  # finite in the file, not after the cast
            raise CheckpointError(f"tensor {name!r} overflows {t.dtype} (values beyond its range)")
        weights[name] = t
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


def make_checkpoint(out_dir: str | Path, preset_or_hf: str | dict, *, seed: int = 0, dtype=torch.bfloat16,
                    shard_bytes: int = 2 << 30, overwrite: bool = False) -> Path:
    """Write a random-weight HF-format checkpoint (config.json + sharded safetensors + index) into a new or empty
    directory (`overwrite`: replace the checkpoint files of a non-empty one).

    Experts are written per expert, the layout of checkpoints on the hub (kimi_k3: MXFP4 experts as
    compressed-tensors `weight_packed` / `weight_scale` uint8 pairs, `random_tensor`'s bytes).
    """
    hf = preset_hf_config(preset_or_hf) if isinstance(preset_or_hf, str) else dict(preset_or_hf)
    cfg = config_from_hf(hf)
    out = Path(out_dir)
    _prepare_out_dir(out, overwrite)
    hf.setdefault("torch_dtype", str(dtype).removeprefix("torch."))
    if cfg.expert_quant == "mxfp4":  # say so, as a compressed-tensors checkpoint does
        hf.setdefault("quantization_config", {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"})
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    gen = torch.Generator().manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, spec in param_specs(cfg).items():
        t = random_tensor(spec, gen, "cpu", dtype)
        if spec.stacked is None:
            pieces = {name: t}
        else:
            names = spec.hf_names(cfg.num_experts)
            chunks = [c for e in t for c in (e.chunk(2, 0) if spec.stacked == "experts_gate_up" else (e,))]
            pieces = {n: c.contiguous() for n, c in zip(names, chunks)}
        for n, c in pieces.items():
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
