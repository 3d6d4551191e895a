"""argparse types the command line's parsers share. Nothing here imports torch, so that building the parsers
(`megadecode --help`, `megadecode serve --help`) does not wait for it."""

from __future__ import annotations

import argparse


def add_quiet(p) -> None:
    p.add_argument("--quiet", action="store_true",
                   help="no progress bars (they are off anyway when stderr is not a terminal)")


def add_speculative(p) -> None:
    """generate's and serve's speculative decoding flags."""
    p.add_argument("--speculative", choices=("ngram", "draft", "mtp"), default=None,
                   help="speculative decoding: drafts from prompt lookup (ngram), a draft model (draft, with "
                        "--draft-model) or the model's own multi-token-prediction layer (mtp: DeepSeek-V3's, where "
                        "the checkpoint has one) verified a step at a time, kept by the target's greedy choice or, "
                        "sampling, by the rejection rule (eager verify steps, one process)")
    p.add_argument("--draft-model", metavar="MODEL",
                   help="with --speculative draft: a smaller model of the same vocabulary (a preset, an HF "
                        "checkpoint directory or a hub name), on the target's device (the graph executor on CUDA, "
                        "the torch one on the CPU)")
    p.add_argument("--num-draft-tokens", type=int, default=3, metavar="K",
                   help="with --speculative: draft tokens a sequence a step, 1 to 7")


def speculative_flags_error(args) -> str | None:
    """What is wrong with the speculative flags' combination, in one line (None: nothing)."""
    if (args.speculative == "draft") != (args.draft_model is not None):
        return "--speculative draft needs --draft-model, and --draft-model needs --speculative draft"
    return None


def bar_off(args, *also: bool) -> bool | None:
    """A progress bar's `disable` for tqdm: True with --quiet or any of `also` (--json, a rank that does not
    report); else None, tqdm's own rule: off when stderr is not a terminal."""
    return True if getattr(args, "quiet", False) or any(also) else None


def byte_feed(bar):
    """A progress(bytes, total bytes) callback (Engine.from_pretrained's) that advances a tqdm bar of bytes."""
    def feed(n: int, total: int) -> None:
        if bar.total != total:
            bar.total = total
        bar.update(n)
    return feed


def int_list(text: str) -> list[int]:
    """`--batch 1,8,64` -> [1, 8, 64]."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    return out


def seed_arg(text: str) -> int:
    """argparse type of `--seed`: an integer in [0, 2**32 - 1] (torch generators take 64 bits, and generate
    derives a seed per step from it: engine.MAX_SEED)."""
    from .engine import MAX_SEED  # on use: the engine imports torch

    try:
        seed = int(text)
    except ValueError:
        seed = None
    if seed is None or not 0 <= seed <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, {MAX_SEED}], got {text!r}")
    return seed
