"""Load test of `megadecode serve` (issue 16, item 6): C concurrent streams, each sending streamed completions of
--max-tokens tokens back to back (greedy, ignore_eos, token ids returned so that every token is its own chunk),
for each C of --concurrency. Per level: output tokens/s in total and per user, time to first token, inter-token
latency p50/p99 (gaps between token arrivals), time per output token (TPOT: first to last token of a request over
its tokens, which does not depend on how reads group chunks), and the server's own mean decode step (from
/metrics). JSON out, with the command.

Either against a running server (--url), or starting one (--serve "ARGS": `python -m megadecode serve --port 0
ARGS` in a subprocess; its startup line, with the cold start, goes into the JSON, and it is stopped at the end):

    python bench/serve_load.py --serve "--model qwen3-30b-a3b --executor fused --device cuda --dtype bfloat16 \\
        --max-batch 64" --concurrency 1,4,16,64 --max-tokens 128 --step-ms 4.25 \\
        --out bench/results/serve-qwen3-30b-a3b-nvidia-h200.json

Needs httpx (the test extra). Prompts are random byte-range token ids (valid in every vocabulary), --prompt-len
long, seeded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def metric(text: str, key: str) -> float:
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    sent = time.perf_counter()
    stamps: list[tuple[float, int]] = []  # (arrival, tokens in the chunk)
    error = None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"}
        buf = b""
        # raw reads, split here: httpx's aiter_lines was seen to hand over a whole response's lines at its end on
        # a kept-alive connection (httpx 0.28, CPU), which would make every inter-token latency zero
        async for raw in r.aiter_raw():
            now = time.perf_counter()
            buf += raw
            *events, buf = buf.split(b"\n\n")
            for ev in events:
                if not ev.startswith(b"data: {"):
                    continue
                doc = json.loads(ev[6:])
                if "error" in doc:
                    error = doc["error"]["message"]
                    break
                n = len(doc["choices"][0].get("token_ids") or []) if doc["choices"] else 0
                if n:
                    stamps.append((now, n))
    if error or not stamps:
        return {"error": error or "no tokens"}
    tokens = sum(n for _, n in stamps)
    itl = [(b - a) / n for (a, _), (b, n) in zip(stamps, stamps[1:])]  # a chunk of n tokens: n gaps
    return {"sent": sent, "first": stamps[0][0], "last": stamps[-1][0], "tokens": tokens,
            "itl": [x for x, (_, n) in zip(itl, stamps[1:]) for _ in range(n)]}


async def level(url: str, model: str, concurrency: int, requests_per_stream: int, max_tokens: int,
                prompt_len: int, seed: int) -> dict:
    rng = random.Random(seed * 1000 + concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        before = (await client.get("/metrics")).text

        async def stream():
            out = []
            for _ in range(requests_per_stream):
                prompt = [rng.randrange(256) for _ in range(prompt_len)]
                out.append(await one_request(client, model, prompt, max_tokens))
            return out

        t0 = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(stream() for _ in range(concurrency))) for r in rs]
        wall = time.perf_counter() - t0
        after = (await client.get("/metrics")).text
    ok = [r for r in results if "error" not in r]
    tokens = sum(r["tokens"] for r in ok)
    ttft = [(r["first"] - r["sent"]) * 1e3 for r in ok]
    itl = [x * 1e3 for r in ok for x in r["itl"]]
    # time per output token after the first (vLLM's TPOT): unlike the gaps between chunks, it does not depend on
    # how the network or the client's reads group the chunks
    tpot = [(r["last"] - r["first"]) / (r["tokens"] - 1) * 1e3 for r in ok if r["tokens"] > 1]
    per_user = [1e3 / t for t in tpot if t > 0]
    key_sum, key_n = 'megadecode_step_seconds_sum{kind="decode"}', 'megadecode_step_seconds_count{kind="decode"}'
    steps = metric(after, key_n) - metric(before, key_n)
    step_ms = (metric(after, key_sum) - metric(before, key_sum)) / steps * 1e3 if steps else None
    rnd = lambda x: None if x is None else round(x, 3)  # noqa: E731
    return {"concurrency": concurrency, "requests": len(results), "errors": len(results) - len(ok),
            "error_examples": sorted({r["error"] for r in results if "error" in r})[:3],
            "max_tokens": max_tokens, "prompt_len": prompt_len, "output_tokens": tokens, "wall_s": rnd(wall),
            "total_tokens_per_s": rnd(tokens / wall),
            "per_user_tokens_per_s": rnd(statistics.mean(per_user)) if per_user else None,
            "ttft_ms_p50": rnd(percentile(ttft, 0.5)), "ttft_ms_p99": rnd(percentile(ttft, 0.99)),
            "itl_ms_p50": rnd(percentile(itl, 0.5)), "itl_ms_p99": rnd(percentile(itl, 0.99)),
            "itl_ms_mean": rnd(statistics.mean(itl)) if itl else None, "tpot_ms_p50": rnd(percentile(tpot, 0.5)),
            "tpot_ms_p99": rnd(percentile(tpot, 0.99)), "server_decode_step_ms_mean": rnd(step_ms),
            "server_decode_steps": int(steps)}


def start_server(args_text: str) -> tuple[subprocess.Popen, str, str, float]:
    """`python -m megadecode serve --port 0 ARGS`; returns (process, url, its startup line, spawn time)."""
    cmd = [sys.executable, "-m", "megadecode", "serve", "--port", "0", *shlex.split(args_text)]
    spawned = time.perf_counter()
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    lines = []
    while True:
        line = p.stderr.readline()
        if not line:
            raise SystemExit("the server exited before serving:\n" + "".join(lines[-30:]))
        lines.append(line)
        sys.stderr.write(line)
        m = re.search(r"at (http://[^/]+)/v1;", line)
        if m:
            return p, m.group(1), line.strip(), spawned


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    src.add_argument("--serve", metavar="ARGS", help="start `megadecode serve --port 0 ARGS` and stop it at the end")
    ap.add_argument("--model", default=None, help="model name to request (default: the server's, from /v1/models)")
    ap.add_argument("--concurrency", default="1,4,16,64", help="concurrent streams, one level each")
    ap.add_argument("--requests-per-stream", type=int, default=4, help="requests each stream sends back to back")
    ap.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request")
    ap.add_argument("--step-ms", type=float, default=None,
                    help="the bench's decode step at batch 1 (ms), to compare the 1-stream inter-token latency with")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    ap.add_argument("--out", default=None, help="JSON file (default: print only)")
    args = ap.parse_args(argv)

    proc, startup, first_token_s = None, None, None
    url = args.url
    if args.serve:
        proc, url, startup, spawned = start_server(args.serve)
    try:
        models = httpx.get(url + "/v1/models", timeout=30).json()["data"]
        model = args.model or models[0]["id"]
        if proc is not None:  # spawn to the first token of a first request: what a user waits for
            r = asyncio.run(level(url, model, 1, 1, 2, args.prompt_len, args.seed))
            first_token_s = round(time.perf_counter() - spawned, 3) if r["errors"] == 0 else None
        asyncio.run(level(url, model, 1, 1, 8, args.prompt_len, args.seed))  # untimed: connections, allocator
        rows = []
        for c in [int(x) for x in args.concurrency.split(",") if x.strip()]:
            row = level(url, model, c, args.requests_per_stream, args.max_tokens, args.prompt_len, args.seed)
            rows.append(asyncio.run(row))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    one = next((r for r in rows if r["concurrency"] == 1), None)
    goal = None
    if args.step_ms and one and one["itl_ms_p50"]:
        goal = {"bench_step_ms": args.step_ms, "itl_ms_p50": one["itl_ms_p50"], "tpot_ms_p50": one["tpot_ms_p50"],
                "ratio_itl": round(one["itl_ms_p50"] / args.step_ms, 3),
                "ratio_tpot": round(one["tpot_ms_p50"] / args.step_ms, 3),
                "within_10_percent": max(one["itl_ms_p50"], one["tpot_ms_p50"]) <= 1.1 * args.step_ms}
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except OSError:
        sha = None
    doc = {"command": "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])]),
           "git_sha": os.environ.get("MEGADECODE_GIT_SHA") or sha, "model": model, "server_startup": startup,
           "spawn_to_first_token_s": first_token_s, "goal_one_stream_itl": goal, "rows": rows}
    text = json.dumps(doc, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
        print(f"wrote {args.out}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
