"""Prometheus metrics for GET /metrics (one registry per server, so tests can run several).

Names follow SGLang's `sglang:*` family under a `dspark:` prefix.  The speculative gauges
(accept length, verify window = SGLang's cap length, ceiling = block accept length) are interval
gauges: the mean over the rounds of the most recent engine step that ran a speculative round;
do not apply rate() to them.
"""

from __future__ import annotations

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

P = "dspark:"


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str = "", speculative: bool = False):
        r = self.registry = CollectorRegistry()
        self.speculative = speculative
        self.requests = Counter(P + "requests", "Finished generation requests", ["finish_reason"], registry=r)
        self.http_errors = Counter(P + "http_errors", "Requests rejected with a 4xx/5xx", ["status"], registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Generated (committed) tokens", registry=r)
        self.steps = Counter(P + "engine_steps", "Engine scheduling steps", registry=r)
        self.running = Gauge(P + "num_running_reqs", "Requests holding a slot", registry=r)
        self.queued = Gauge(P + "num_queue_reqs", "Requests waiting for a slot or KV pages", registry=r)
        self.kv_usage = Gauge(P + "kv_pool_usage", "Fraction of usable KV pages reserved", registry=r)
        self.kv_used = Gauge(P + "kv_used_pages", "KV pages reserved by requests", registry=r)
        self.kv_total = Gauge(P + "kv_total_pages", "Usable KV pages", registry=r)
        self.token_capacity = Gauge(P + "token_capacity", "KV pool capacity in tokens", registry=r)
        self.gen_throughput = Gauge(P + "gen_throughput", "Generated tokens/s over the last few seconds", registry=r)
        buckets = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
        self.step_time = Histogram(P + "step_time_seconds", "Wall time of one engine step", buckets=buckets, registry=r)
        lat = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Arrival to first token", buckets=lat, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Arrival to finish", buckets=lat, registry=r)
        if speculative:
            self.spec_accept_length = Gauge(P + "spec_accept_length", "Mean tokens committed per verify (bonus included)", registry=r)
            self.spec_cap_length = Gauge(P + "spec_cap_length", "Mean verify window (anchor included)", registry=r)
            self.spec_block_accept_length = Gauge(P + "spec_block_accept_length", "Mean uncapped block accept length (ceiling)", registry=r)
            self.spec_utilization = Gauge(P + "spec_utilization", "accept length / ceiling", registry=r)
            self.spec_verify_calls = Counter(P + "spec_verify_calls", "Speculative verify rows", registry=r)
            # sums beside the row count, so any interval's mean window and accept length is a ratio of deltas
            self.spec_verify_tokens = Counter(P + "spec_verify_tokens", "Tokens verified (windows, anchor included)", registry=r)
            self.spec_accepted_tokens = Counter(P + "spec_accepted_tokens", "Tokens committed by verify rows (bonus included)", registry=r)
        Gauge(P + "model_info", "Served model", ["model"], registry=r).labels(model=model_name).set(1)

    # engine-thread hooks ----------------------------------------------------------------------
    def on_step(self, seconds: float, tokens: int, spec_rounds=None) -> None:
        self.steps.inc()
        self.step_time.observe(seconds)
        self.generation_tokens.inc(tokens)
        if self.speculative and spec_rounds:
            acc, win, blk = (np.asarray(x, dtype=float) for x in spec_rounds)
            self.spec_accept_length.set(acc.mean())
            self.spec_cap_length.set(win.mean())
            self.spec_block_accept_length.set(blk.mean())
            self.spec_utilization.set(acc.sum() / blk.sum() if blk.sum() else 0.0)
            self.spec_verify_calls.inc(len(acc))
            self.spec_verify_tokens.inc(win.sum())
            self.spec_accepted_tokens.inc(acc.sum())

    def on_finish(self, result) -> None:
        self.requests.labels(finish_reason=result.finish_reason).inc()
        self.prompt_tokens.inc(result.stats["prompt_tokens"])
        if result.stats.get("ttft_s") is not None:
            self.ttft.observe(result.stats["ttft_s"])
        self.e2e.observe(result.stats["latency_s"])

    def on_snapshot(self, s: dict) -> None:
        self.running.set(s["num_running_reqs"])
        self.queued.set(s["num_queue_reqs"])
        self.kv_usage.set(s["kv_usage"])
        self.kv_used.set(s["kv_used_pages"])
        self.kv_total.set(s["kv_total_pages"])
        self.token_capacity.set(s["token_capacity"])
        self.gen_throughput.set(s["last_gen_throughput"])

    def on_replica_snapshot(self, replica: int, s: dict) -> None:
        """One data-parallel replica's state (serving/replicas.py): dspark:replica_* gauges with a
        replica label; the unlabelled gauges above then hold the sum over replicas."""
        if not hasattr(self, "_replica_gauges"):
            r, names = self.registry, (("num_running_reqs", "Requests holding a slot"),
                                       ("num_queue_reqs", "Requests waiting for a slot or KV pages"),
                                       ("kv_usage", "Fraction of usable KV pages reserved"),
                                       ("kv_used_pages", "KV pages reserved by requests"),
                                       ("last_gen_throughput", "Generated tokens/s over the last few seconds"))
            self._replica_gauges = {k: Gauge(P + "replica_" + k, h + ", per replica", ["replica"], registry=r)
                                    for k, h in names}
        for k, g in self._replica_gauges.items():
            g.labels(replica=str(replica)).set(s[k])

    def render(self) -> bytes:
        return generate_latest(self.registry)
