"""Tuned launch parameters as data: one JSON file per (kernel, GPU), keyed by problem shape, mapping batch
size to a config (issue 5, item 2). Written by `megadecode tune` on the GPU, read by the launchers.

    megadecode/backends/fused/kernels/configs/<kernel>/<gpu name lowercased, spaces -> dashes>.json
    {"kernel": "fused-experts", "device": "NVIDIA H200",
     "shapes":   {"D=3584,I=3072,A=16,wdtype=mxfp4,act=situ": {"1": {"BLOCK_I": 32, ...}, "8": {...}}},
     "measured": {"D=3584,I=3072,A=16,wdtype=mxfp4,act=situ": {"1": {"ms": ..., "mbu": ..., "command": ...,
                                                                  "date": ...}}}}

Lookup rule: the config of the smallest tuned batch >= the asked batch, else of the largest tuned batch;
None when the file or the shape is absent (the launcher then uses its defaults). Files are read once per
process and cached; a malformed file raises ValueError naming it. No Triton import here (the CLI and the
CPU launch path import this module).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def device_slug(device_name: str) -> str:
    """"NVIDIA H200" -> "nvidia-h200"."""
    return device_name.strip().lower().replace(" ", "-")


def config_path(kernel: str, device_name: str) -> Path:
    return CONFIG_DIR / kernel / f"{device_slug(device_name)}.json"


def validate(data, path) -> dict:
    """Check the file format; -> data. ValueError naming `path` and what is wrong."""
    def bad(why: str):
        return ValueError(f"malformed tuning file {path}: {why}")

    if not isinstance(data, dict) or not isinstance(data.get("shapes"), dict):
        raise bad('expected an object with a "shapes" object')
    for key in ("kernel", "device"):
        if not isinstance(data.get(key), str):
            raise bad(f'"{key}" must be a string')
    if not isinstance(data.get("measured", {}), dict):
        raise bad('"measured" must be an object')
    for shape, by_batch in data["shapes"].items():
        if not isinstance(by_batch, dict) or not by_batch:
            raise bad(f"shape {shape!r}: expected a non-empty object batch -> config")
        for batch, cfg in by_batch.items():
            if not batch.isdigit() or int(batch) < 1:
                raise bad(f"shape {shape!r}: batch key {batch!r} is not a positive integer")
            if not isinstance(cfg, dict) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                    for v in cfg.values()):
                raise bad(f"shape {shape!r}, batch {batch}: expected an object of integer launch parameters")
    return data


def read(path) -> dict:
    """A tuning file, validated (json errors become ValueError naming the file)."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"malformed tuning file {path}: {e}") from None
    return validate(data, path)


def write(path, data: dict) -> None:
    validate(data, path)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


@lru_cache(maxsize=None)
def _load(path: Path) -> dict | None:
    return read(path) if path.is_file() else None


def clear_cache() -> None:
    _load.cache_clear()


def lookup(kernel: str, device_name: str, shape_key: str, batch: int) -> dict | None:
    """The tuned config for `batch`: the entry of the smallest tuned batch >= batch, else of the largest;
    None when no file for (kernel, device) exists or it lacks `shape_key`."""
    data = _load(config_path(kernel, device_name))
    by_batch = None if data is None else data["shapes"].get(shape_key)
    if not by_batch:
        return None
    tuned = sorted(int(b) for b in by_batch)
    pick = next((b for b in tuned if b >= batch), tuned[-1])
    return dict(by_batch[str(pick)])


def merge(data: dict | None, kernel: str, device_name: str, shape_key: str, batch: int, config: dict,
          measured: dict) -> dict:
    """`data` (a tuning file's content, or None for a new one) with (shape_key, batch) set to `config` and
    its measurement; other shapes and batches are kept."""
    data = data or {"kernel": kernel, "device": device_name, "shapes": {}, "measured": {}}
    data.setdefault("measured", {})
    data["shapes"].setdefault(shape_key, {})[str(batch)] = dict(config)
    data["measured"].setdefault(shape_key, {})[str(batch)] = dict(measured)
    return data
