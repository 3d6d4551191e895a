"""The server's Prometheus metrics (GET /metrics, text format), in a registry of their own per server.

    megadecode_requests_total{outcome}            finished requests: stop, length, abort, error (each of a
                                                  request's n choices counts as one); rejected (429), invalid
                                                  (400, or 404 for an unknown model)
    megadecode_prompt_tokens_total                prompt tokens of admitted requests (once a request: its
                                                  choices share the prompt's prefill)
    megadecode_generation_tokens_total            tokens generated
    megadecode_running_requests                   sequences in the decode batch (slots held)
    megadecode_waiting_requests                   the queue's length
    megadecode_batch_occupancy                    running / --max-batch
    megadecode_step_seconds{kind}                 prefill and decode step times (histogram)
    megadecode_decode_batch_size                  running sequences per decode step (histogram; padded rows not
                                                  counted: megadecode_decode_padding_rows_total)
    megadecode_time_to_first_token_seconds        request arrival to its first token (histogram)
    megadecode_cold_start_seconds                 process start to the first token of the startup request
    megadecode_spec_draft_tokens_total            speculative decoding: draft tokens proposed, and of them
    megadecode_spec_accepted_tokens_total         accepted (--speculative)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..sequence import Sequence

STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
                0.25, 0.5, 1.0, 2.5)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self, max_batch: int):
        self.max_batch = max_batch
        r = self.registry = CollectorRegistry()
        self.requests = Counter("megadecode_requests", "finished requests by outcome", ["outcome"], registry=r)
        self.prompt_tokens = Counter("megadecode_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("megadecode_generation_tokens", "tokens generated", registry=r)
        self.running = Gauge("megadecode_running_requests", "sequences in the decode batch", registry=r)
        self.waiting = Gauge("megadecode_waiting_requests", "requests in the queue", registry=r)
        self.occupancy = Gauge("megadecode_batch_occupancy", "running sequences / max batch", registry=r)
        self.step_seconds = Histogram("megadecode_step_seconds", "step time", ["kind"], buckets=STEP_BUCKETS,
                                      registry=r)
        self.batch_size = Histogram("megadecode_decode_batch_size", "running sequences per decode step",
                                    buckets=tuple(sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, max_batch})), registry=r)
        self.padding = Counter("megadecode_decode_padding_rows", "padding rows run by decode steps", registry=r)
        self.ttft = Histogram("megadecode_time_to_first_token_seconds", "request arrival to first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.cold_start = Gauge("megadecode_cold_start_seconds", "process start to the first token of the startup "
                                "request", registry=r)
        self.spec_drafted = Counter("megadecode_spec_draft_tokens", "draft tokens proposed", registry=r)
        self.spec_accepted = Counter("megadecode_spec_accepted_tokens", "draft tokens accepted", registry=r)
        for outcome in ("stop", "length", "abort", "error", "rejected", "invalid"):
            self.requests.labels(outcome)  # present from the start, at 0

    # ---- the engine loop's reports (serve/loop.py NullMetrics) -------------------------------------------------
    def step(self, kind: str, seconds: float, batch: int, padded: int) -> None:
        self.step_seconds.labels(kind).observe(seconds)
        self.generation_tokens.inc(batch)
        if kind == "decode":
            self.batch_size.observe(batch)
            self.padding.inc(padded - batch)

    def state(self, waiting: int, running: int) -> None:
        self.waiting.set(waiting)
        self.running.set(running)
        self.occupancy.set(running / self.max_batch)

    def finished(self, seq: Sequence) -> None:
        self.requests.labels(seq.finish_reason or "error").inc()

    def speculated(self, drafted: int, accepted: int) -> None:
        """A verify step's drafts; the accepted ones are generated tokens beyond the step's one a sequence."""
        self.spec_drafted.inc(drafted)
        self.spec_accepted.inc(accepted)
        self.generation_tokens.inc(accepted)

    # ---- the HTTP layer's -----------------------------------------------------------------------------------------
    def admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def refused(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
