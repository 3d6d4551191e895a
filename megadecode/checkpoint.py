"""HF-format safetensors checkpoints: load through the weight table, and write random ones."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import ModelConfig, load_config
from .presets import preset_hf_config
from .config import config_from_hf
from .weights import param_specs, random_tensor

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class CheckpointError(ValueError):
    """A checkpoint that does not match its config, with the tensor that is wrong."""


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


def load_weights(ckpt: str | Path, cfg: ModelConfig | None = None, *, device="cpu", dtype=torch.float32,
                 check_finite: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load every tensor the weight table expects, checking names, shapes and dtypes.

    Routed experts may be stored per expert (HF hub layout) or already stacked. Extra tensors (e.g.
    DeepSeek's multi-token-prediction layer) are ignored. With `check_finite`, NaN/inf is an error
    naming the tensor.
    """
    ckpt = Path(ckpt)
    cfg = cfg or load_config(ckpt)
    where = _index_files(ckpt)
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


def make_checkpoint(out_dir: str | Path, preset_or_hf: str | dict, *, seed: int = 0, dtype=torch.bfloat16,
                    shard_bytes: int = 2 << 30) -> Path:
    """Write a random-weight HF-format checkpoint (config.json + sharded safetensors + index).

    Experts are written per expert, the layout of checkpoints on the hub (kimi_k3: MXFP4 experts as
    compressed-tensors `weight_packed` / `weight_scale` uint8 pairs, `random_tensor`'s bytes).
    """
    hf = preset_hf_config(preset_or_hf) if isinstance(preset_or_hf, str) else dict(preset_or_hf)
    cfg = config_from_hf(hf)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
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
