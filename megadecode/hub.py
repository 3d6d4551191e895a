"""`--model ORG/NAME`: a model of the Hugging Face hub, found in the local cache (huggingface_hub, offline:
megadecode never downloads). A preset or an existing directory is taken as it is."""

from __future__ import annotations

import os
from pathlib import Path

from .presets import PRESETS


def cache_dir() -> str:
    """The hub cache huggingface_hub reads: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def looks_like_repo_id(model: str) -> bool:
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "~")) and "\\" not in model


def resolve_model(model: str) -> str:
    """A preset name or checkpoint directory as given; ORG/NAME (not a directory here) as the folder of its
    snapshot in the local hub cache (the revision `main` points to). FileNotFoundError, naming the cache, when it is
    not there."""
    if model in PRESETS or Path(model).is_dir() or not looks_like_repo_id(model):
        return model  # model_config says what is wrong with a name that is none of these
    cache = cache_dir()
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # transformers depends on it: only a broken install lands here
        raise FileNotFoundError(f"--model {model!r}: huggingface_hub is needed to look it up in the local Hugging "
                                "Face cache (pip install huggingface_hub)") from None
    try:
        return snapshot_download(model, cache_dir=cache, local_files_only=True)
    except Exception:  # noqa: BLE001 - huggingface_hub's LocalEntryNotFoundError and kin: not in the cache
        raise FileNotFoundError(f"--model {model!r} is neither a preset ({', '.join(sorted(PRESETS))}), a checkpoint "
                                f"directory, nor in the local Hugging Face cache ({cache}; megadecode does not "
                                f"download: `hf download {model}` does)") from None
