"""Writes layout_names-<transformers version>.json.gz: the tensor names and shapes that transformers'
save_pretrained writes for the tiny presets of each family it knows, in its default (original) format and with
save_original_format=False (its own stacked names). Run it with a transformers other than the pinned one to pin
that version's layouts for tests/test_layouts.py, e.g. the newest 5.x in a separate virtualenv:

    python -m venv --system-site-packages /tmp/tf-new && /tmp/tf-new/bin/pip install -U 'transformers>=5.17,<6'
    PYTHONPATH=. /tmp/tf-new/bin/python tests/data/make_layout_names.py
"""

from __future__ import annotations

import gzip
import json
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors import safe_open

from megadecode.presets import preset_hf_config

MODELS = {"tiny-qwen3-moe": "Qwen3Moe", "tiny-deepseek-v3": "DeepseekV3", "tiny-kimi-linear": "KimiLinear"}


def names(model, original: bool) -> dict[str, list[int]]:
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, save_original_format=original)
        out = {}
        for f in sorted(Path(tmp).glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                out.update({k: list(h.get_slice(k).get_shape()) for k in h.keys()})
    return dict(sorted(out.items()))


def main() -> None:
    torch.manual_seed(0)
    doc = {"transformers": transformers.__version__, "models": {}}
    for preset, prefix in MODELS.items():
        d = preset_hf_config(preset)
        cfg = getattr(transformers, f"{prefix}Config")(**{k: v for k, v in d.items() if k != "model_type"})
        model = getattr(transformers, f"{prefix}ForCausalLM")(cfg)
        doc["models"][preset] = {"config": cfg.to_dict(), "save_pretrained": names(model, True),
                                 "save_original_format=False": names(model, False)}
    path = Path(__file__).with_name(f"layout_names-{transformers.__version__}.json.gz")  # gzip: the repo stays small
    path.write_bytes(gzip.compress((json.dumps(doc, separators=(",", ":")) + "\n").encode(), mtime=0))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
