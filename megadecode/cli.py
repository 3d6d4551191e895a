"""The `megadecode` command: generate text, write random checkpoints, benchmark decode steps.

    megadecode generate --model tiny-qwen3-moe --greedy
    megadecode make-checkpoint --preset tiny-deepseek-v3 --out /tmp/ckpt
    megadecode bench --preset qwen3-30b-a3b --batch 1,8,64 --executor torch,graph   (GPU only)
    megadecode validate --list; megadecode validate triton-router --quick
    megadecode tune --kernel fused-experts --shape k3 --batch 1,2,4,8,16   (GPU only)

Errors the user can fix (bad config, checkpoint, request or argument) print one line,
`megadecode: error: <message>`, and exit with code 2.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from . import bench, tune
from .checkpoint import CheckpointError, make_checkpoint
from .config import ConfigError
from .engine import Engine, RequestError, resolve_dtype
from .executors import EXECUTORS
from .presets import PRESETS
from .sampling import SamplingParams
from .tokenizer import load_tokenizer
from .validate import command as validate_command

DEFAULT_PROMPT = "Hello, megadecode!"
# What a user can get wrong; anything else is a bug and keeps its traceback.
USER_ERRORS = (ConfigError, CheckpointError, RequestError, FileNotFoundError, ValueError)


def token_id_list(text: str) -> list[int]:
    """`--token-ids 256,1,2` -> [256, 1, 2]."""
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one token id")
    return ids


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate tokens from a preset (random weights) or a checkpoint",
                       description="Generate tokens with a preset (random weights) or an HF checkpoint directory.")
    p.add_argument("--model", default="tiny-qwen3-moe",
                   help=f"preset ({', '.join(sorted(PRESETS))}) or checkpoint directory (default: %(default)s)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", metavar="TEXT",
                     help=f"prompt text; repeat for a batch (default: {DEFAULT_PROMPT!r})")
    src.add_argument("--token-ids", action="append", type=token_id_list, metavar="IDS",
                     help="prompt as comma-separated token ids; repeat for a batch")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--executor", choices=sorted(EXECUTORS), default="torch")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (ignores --temperature/--top-p)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="seed of the preset's random weights and of sampling")
    p.add_argument("--check-finite", action="store_true", help="reject checkpoint tensors with NaN/inf")
    p.add_argument("--json", action="store_true", help="print one JSON object to stdout and nothing else")
    p.set_defaults(func=cmd_generate)


def _add_make_checkpoint(sub) -> None:
    p = sub.add_parser("make-checkpoint", help="write a random-weight HF-format checkpoint of a preset",
                       description="Write a random-weight HF-format checkpoint (config.json + safetensors).")
    p.add_argument("--preset", required=True, help=f"one of {', '.join(sorted(PRESETS))}")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.set_defaults(func=cmd_make_checkpoint)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megadecode", description="Decode engine for extremely sparse Mixture-of-Experts models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,make-checkpoint,bench,validate,tune}")
    _add_generate(sub)
    _add_make_checkpoint(sub)
    bench.add_parser(sub)
    validate_command.add_parser(sub)
    tune.add_parser(sub)
    return parser


def cmd_generate(args, argv) -> int:
    from tqdm import tqdm

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU is available")
    is_preset = args.model in PRESETS
    tok = load_tokenizer(None if is_preset else args.model)
    if args.token_ids:
        prompts = args.token_ids
    else:
        prompts = [tok.encode(t) for t in (args.prompt or [DEFAULT_PROMPT])]
    sampling = SamplingParams(greedy=args.greedy, temperature=args.temperature, top_p=args.top_p)
    if args.max_new_tokens < 0:
        raise RequestError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    engine = Engine.from_pretrained(args.model, device=args.device, dtype=args.dtype, executor=args.executor,
                                    seed=args.seed, check_finite=args.check_finite, max_batch=len(prompts),
                                    max_seq_len=max(len(p) for p in prompts) + args.max_new_tokens)
    engine.check_request(prompts, args.max_new_tokens)  # before the progress bar shows up
    progress = tqdm(total=max(args.max_new_tokens - 1, 0), desc="decode", unit="step", file=sys.stderr,
                    disable=args.json)
    with progress:
        res = engine.generate(prompts, args.max_new_tokens, sampling, seed=args.seed, progress=progress)
    texts = [tok.decode(ids) for ids in res.token_ids]
    if args.json:
        print(json.dumps({
            "model": args.model, "executor": args.executor, "device": args.device, "dtype": args.dtype,
            "token_ids": res.token_ids, "logprobs": res.logprobs, "text": texts,
            "prefill_s": res.prefill_s, "decode_s": res.decode_s,
            "decode_tokens_per_s": res.decode_tokens_per_s}))
        return 0
    for i, (prompt, text) in enumerate(zip(prompts, texts)):
        print(f"[{i}] {tok.decode(prompt)!r} -> {text!r}")
    print(f"prefill {res.prefill_s * 1e3:.1f} ms, decode {res.decode_steps} steps x {len(prompts)} sequences "
          f"in {res.decode_s * 1e3:.1f} ms: {res.decode_tokens_per_s:.1f} tokens/s "
          f"({args.executor}, {args.device}, {args.dtype})")
    return 0


def cmd_make_checkpoint(args, argv) -> int:
    out = make_checkpoint(args.out, args.preset, seed=args.seed, dtype=resolve_dtype(args.dtype))
    print(f"wrote {args.preset} checkpoint ({args.dtype}, seed {args.seed}) to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args, argv)
    except USER_ERRORS as e:
        print(f"megadecode: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
