"""GET /metrics: the server's counters in Prometheus' text format (prometheus-client), with
vLLM's kinds of figures under the `meshformer:` prefix.

requests_total{path, status}: responses ended (AccessLog counts them; path: the route, e.g.
/v1/models/{model_id:path}, or "unrouted" for a 404 of no route); prompt_tokens_total,
generation_tokens_total: tokens prefilled and sampled; num_requests_running /
num_requests_waiting: sequences in slots and in the queue (read from the engine when
scraped); time_to_first_token_seconds (from submit to the first sampled token) and
time_per_output_token_seconds (between a sequence's tokens) as histograms. The engine
reports to it from its thread (prometheus-client's metrics are thread-safe).

As vLLM's log, a line every MESHFORMER_LOG_STATS_INTERVAL seconds (default 10) while the
server is busy: prompt and generation tokens/s over the interval, sequences running and
waiting (report_throughput).
"""

import os
import threading
import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "meshformer:"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Metrics:
    """The server's figures, in a registry of their own (two servers in one process do not mix)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(PREFIX + "requests", "HTTP responses ended, by path and status", ["path", "status"], registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "tokens sampled", registry=r)
        self.engine = engine
        Gauge(PREFIX + "num_requests_running", "sequences in slots", registry=r).set_function(lambda: engine.busy()[0])
        Gauge(PREFIX + "num_requests_waiting", "sequences waiting for a slot", registry=r).set_function(lambda: engine.busy()[1])
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "submit to first token", buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds", "between a sequence's tokens", buckets=TPOT_BUCKETS, registry=r)

    def text(self):
        return generate_latest(self.registry)

    def report_throughput(self, interval=None):
        """Print the throughput line every `interval` seconds (MESHFORMER_LOG_STATS_INTERVAL) from a thread of its own;
        an idle interval prints nothing."""
        interval = interval or float(os.environ.get("MESHFORMER_LOG_STATS_INTERVAL", 10))

        def counts():
            return tuple(self.registry.get_sample_value(PREFIX + name + "_total") for name in ("prompt_tokens", "generation_tokens"))

        def loop():
            totals = counts()
            while True:
                time.sleep(interval)
                now = counts()
                (prompt, generation), (running, waiting) = (b - a for a, b in zip(totals, now)), self.engine.busy()
                totals = now
                if prompt or generation or running or waiting:
                    print(f"throughput: prompt {prompt / interval:.1f} tokens/s, generation {generation / interval:.1f} tokens/s, "
                          f"running {running}, waiting {waiting} (last {interval:g} s)", flush=True)

        threading.Thread(target=loop, name="throughput", daemon=True).start()

    # --- from the engine's thread

    def submitted(self, seq):
        seq.last_token_at = None
        seq.submitted_at = time.perf_counter()

    def admitted(self, seq):
        self.prompt_tokens.inc(len(seq.prompt_ids))

    def token(self, seq):
        now = time.perf_counter()
        self.generation_tokens.inc()
        if seq.last_token_at is None:
            self.ttft.observe(now - seq.submitted_at)
        else:
            self.tpot.observe(now - seq.last_token_at)
        seq.last_token_at = now
