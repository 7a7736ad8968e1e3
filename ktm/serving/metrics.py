"""``/metrics``: the server's counters in Prometheus' text format, through ``prometheus_client``.

Names follow vLLM's (``vllm:`` -> ``ktm:``) where vLLM has the figure, so the dashboards
operators already have read them; the rest are ktm's own:

    ktm:http_requests_total{route,status}       answers, by route and HTTP status
    ktm:num_requests_running                    requests decoding now (vLLM's name)
    ktm:num_requests_waiting                    requests queued for a batch row (vLLM's name)
    ktm:time_to_first_token_seconds             from a request's arrival to its first token
    ktm:e2e_request_latency_seconds             from its arrival to its last token
    ktm:prompt_tokens_total                     prompt tokens in (vLLM's name)
    ktm:prompt_positions_total                  positions the LM read for them after merging
    ktm:generation_tokens_total                 tokens generated (vLLM's name)
    ktm:prefix_cache_queries_total              prompt positions looked up in the prefix cache
    ktm:prefix_cache_hits_total                 of those, positions whose KV was reused
    ktm:request_success_total{finished_reason}  choices ended by "stop" or "length"
    ktm:request_failure_total{reason}           choices ended otherwise: cancelled (the client
                                                went), rejected (too long), failed, shutdown
    ktm:history_requests_total{reading}         chats read within a budget, by the furthest
                                                step they needed: plain, merged, deeper, dropped
    ktm:history_messages_total{reading}         their older messages merged, read deeper, left out
    ktm:history_reads_ahead_total               next turns read ahead (--history-ahead)

Tokens and positions count each choice's prompt as it is prefilled (a request of ``n`` choices
prefills it ``n`` times; the server's own reads ahead are counted apart), so with one choice per
request they equal the sums of the usage the clients got. Each app has a registry of its own
(``prometheus_client``'s global one would mix the servers a process creates).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# vLLM's buckets for the same histograms (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """The server's metrics, in a registry of their own. ``running`` and ``waiting`` are read
    when scraped."""

    def __init__(self, running: Callable[[], int], waiting: Callable[[], int]):
        self.registry = r = CollectorRegistry()
        self.http = Counter("ktm:http_requests", "HTTP answers by route and status",
                            ["route", "status"], registry=r)
        Gauge("ktm:num_requests_running", "Requests decoding now",
              registry=r).set_function(running)
        Gauge("ktm:num_requests_waiting", "Requests waiting for a batch row",
              registry=r).set_function(waiting)
        self.ttft = Histogram("ktm:time_to_first_token_seconds",
                              "Time from a request's arrival to its first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.e2e = Histogram("ktm:e2e_request_latency_seconds",
                             "Time from a request's arrival to its last token",
                             buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("ktm:prompt_tokens", "Prompt tokens prefilled",
                                     registry=r)
        self.prompt_positions = Counter("ktm:prompt_positions",
                                        "Positions the LM read for the prompts after merging",
                                        registry=r)
        self.generation_tokens = Counter("ktm:generation_tokens", "Tokens generated", registry=r)
        self.cache_queries = Counter("ktm:prefix_cache_queries",
                                     "Prompt positions looked up in the prefix cache", registry=r)
        self.cache_hits = Counter("ktm:prefix_cache_hits",
                                  "Prompt positions whose KV the prefix cache gave", registry=r)
        self.success = Counter("ktm:request_success", "Choices ended by stop or length",
                               ["finished_reason"], registry=r)
        self.failure = Counter("ktm:request_failure", "Choices ended before their end",
                               ["reason"], registry=r)
        self.history = Counter("ktm:history_requests",
                               "Chats read within a history budget, by the furthest step",
                               ["reading"], registry=r)
        self.history_messages = Counter("ktm:history_messages",
                                        "Older messages of budgeted chats by how they were read",
                                        ["reading"], registry=r)
        self.ahead = Counter("ktm:history_reads_ahead", "Next chat turns read ahead",
                             registry=r)

    def count_http(self, route: str, status: int) -> None:
        self.http.labels(route, str(status)).inc()

    def count_history(self, reading) -> None:
        """A chat read within its budget (``ktm.serving.history.HistoryReading``)."""
        steps = {"dropped": reading.dropped, "deeper": reading.deeper, "merged": reading.merged}
        self.history.labels(next((s for s, n in steps.items() if n), "plain")).inc()
        for step, n in steps.items():
            if n:
                self.history_messages.labels(step).inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
