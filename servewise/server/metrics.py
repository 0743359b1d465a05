"""Prometheus metrics of a serving engine: queue and KV-pool gauges and preemption counters read at
scrape time, latency histograms and outcome counters updated as requests finish.

Beside servewise's own names, the core ones are given under vLLM's names too (`vllm:` prefix, a
`model_name` label; `_VllmNames`), so that vLLM's Grafana dashboard and other tools built for vLLM's
/metrics read a servewise server as they read vLLM."""
from __future__ import annotations

import gc
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _EngineState:
    """Read the engine's queues, pools and preemption counts when scraped."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        st = self.engine.stats()
        queues = GaugeMetricFamily("servewise_requests", "Requests by scheduler queue", labels=["state"])
        for state in ("running", "waiting", "swapped"):
            queues.add_metric([state], getattr(st, state))
        yield queues
        used = GaugeMetricFamily("servewise_kv_blocks_used", "KV-cache blocks in use", labels=["pool"])
        total = GaugeMetricFamily("servewise_kv_blocks_total", "KV-cache blocks in the pool", labels=["pool"])
        usage = GaugeMetricFamily("servewise_kv_usage_ratio", "Share of the pool's KV blocks in use", labels=["pool"])
        for pool, ps in (("device", st.device_blocks), ("host", st.host_blocks)):
            used.add_metric([pool], ps.used)
            total.add_metric([pool], ps.total)
            usage.add_metric([pool], ps.used / ps.total if ps.total else 0.0)
        yield from (used, total, usage)
        pre = CounterMetricFamily("servewise_preemptions", "Preemptions by kind (swap_fallback: swap wanted, "
                                  "host pool full, recomputed)", labels=["kind"])
        for kind, n in st.preemptions.items():
            pre.add_metric([kind], n)
        yield pre
        if st.preemptions_by_priority:
            by = CounterMetricFamily("servewise_preemptions_by_priority", "Preemptions by the preempted request's "
                                     "priority (--policy priority)", labels=["priority"])
            for rank, n in sorted(st.preemptions_by_priority.items()):
                by.add_metric([str(rank)], n)
            yield by
        yield CounterMetricFamily("servewise_recomputed_tokens", "Computed tokens whose KV was dropped to be "
                                  "computed again (recompute preemptions): the recompute tax", value=st.dropped_tokens)
        swap = CounterMetricFamily("servewise_kv_swap_bytes", "KV bytes copied to the host pool (out) and back (in)",
                                   labels=["direction"])
        swap.add_metric(["out"], st.swap_bytes[0])
        swap.add_metric(["in"], st.swap_bytes[1])
        yield swap
        if (lengths := st.lengths) is not None:
            yield CounterMetricFamily("servewise_length_predictions", "Requests whose output length was predicted",
                                      value=lengths["predictions"])
            yield CounterMetricFamily("servewise_length_predictions_observed", "Finished requests compared with "
                                      "their predicted length", value=lengths["observed"])
            yield GaugeMetricFamily("servewise_length_prediction_mae_tokens", "Mean absolute error of the predicted "
                                    "output lengths (the predictor's WordPiece tokens)", value=lengths["mae_wordpiece"])
            yield CounterMetricFamily("servewise_length_prediction_seconds", "Worker time spent predicting output "
                                      "lengths (embedding included)",
                                      value=lengths["predict_s"])
            yield CounterMetricFamily("servewise_length_predictor_refits", "Continual-learning refits of the "
                                      "length predictor", value=lengths["refits"])
        prefix = CounterMetricFamily("servewise_prefix_cache_tokens", "Tokens of the requests admitted to compute "
                                     "(admitted) and of those, the tokens whose KV cached prefix blocks supplied (hit) "
                                     "or the global KV store did (store)", labels=["kind"])
        prefix.add_metric(["admitted"], st.admitted_tokens)
        prefix.add_metric(["hit"], st.prefix_hit_tokens)
        prefix.add_metric(["store"], st.store_hit_tokens)
        yield prefix
        yield CounterMetricFamily("servewise_engine_busy_seconds", "Seconds the engines spent in steps (compute and "
                                  "copies), summed over instances: its rate is their utilisation", value=st.busy_s)
        yield CounterMetricFamily("servewise_engine_heap_trims", "Times the engines gave their free heap back to the "
                                  "system (at start and after steps that built kernels for new shapes), summed over "
                                  "instances", value=st.heap_trims)
        yield CounterMetricFamily("servewise_engine_heap_released_bytes", "Resident bytes those trims released",
                                  value=st.heap_released_bytes)
        yield GaugeMetricFamily("servewise_prefix_cached_blocks", "Device blocks holding cached prefix KV that no "
                                "request holds (counted free)", value=st.cached_blocks)
        if (handoffs := getattr(self.engine, "handoffs", None)) is not None:  # a cluster
            ho = CounterMetricFamily("servewise_kv_handoffs", "KV hand-offs between instances by outcome "
                                     "(committed; recomputed: bad checksum; expired: lease ran out; lost: "
                                     "requests failed with a dead instance)", labels=["outcome"])
            for outcome, n in handoffs.items():
                ho.add_metric([outcome], n)
            yield ho
            up = GaugeMetricFamily("servewise_instance_up", "Whether each instance is up", labels=["instance", "role"])
            busy = CounterMetricFamily("servewise_instance_busy_seconds", "Seconds each instance spent in steps "
                                       "(all its lives): its rate is that instance's utilisation",
                                       labels=["instance", "role"])
            for m in self.engine.instance_info():
                up.add_metric([str(m["index"]), m["role"]], float(m["up"]))
                busy.add_metric([str(m["index"]), m["role"]], m["busy_s"])
            yield up
            yield busy


class _VllmNames:
    """The engine's gauges and counters as vLLM's metrics name them (read at scrape time)."""

    def __init__(self, engine, model_name: str):
        self.engine, self.model = engine, model_name

    def collect(self):
        st = self.engine.stats()
        labels, value = ["model_name"], [self.model]

        def one(kind, name: str, doc: str, v: float):
            m = kind(name, doc, labels=labels)
            m.add_metric(value, v)
            return m

        yield one(GaugeMetricFamily, "vllm:num_requests_running", "Requests in the running batch", st.running)
        yield one(GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting to be served", st.waiting)
        yield one(GaugeMetricFamily, "vllm:num_requests_swapped", "Requests swapped out to the host pool", st.swapped)
        dev = st.device_blocks
        share = dev.used / dev.total if dev.total else 0.0
        yield one(GaugeMetricFamily, "vllm:kv_cache_usage_perc", "Share of the device KV blocks in use (1: all)", share)
        yield one(GaugeMetricFamily, "vllm:gpu_cache_usage_perc", "Share of the device KV blocks in use (vLLM V0's "
                  "name, which its dashboard reads)", share)
        yield one(CounterMetricFamily, "vllm:num_preemptions", "Preemptions of any kind",
                  sum(st.preemptions.values()))
        yield one(CounterMetricFamily, "vllm:prefix_cache_queries", "Prompt tokens admitted (looked up in the prefix "
                  "cache)", st.admitted_tokens)
        yield one(CounterMetricFamily, "vllm:prefix_cache_hits", "Admitted prompt tokens a cached prefix supplied",
                  st.prefix_hit_tokens)


class _GcPauses:
    """The server process's garbage collections: how many, their total and longest pause by generation
    (a full collection stalls every stream the server is sending). One per process, whatever the apps."""

    def __init__(self):
        self.count, self.seconds, self.longest = [0] * 3, [0.0] * 3, [0.0] * 3
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        g, dt = info["generation"], time.perf_counter() - self._start
        self.count[g] += 1
        self.seconds[g] += dt
        self.longest[g] = max(self.longest[g], dt)

    def collect(self):
        n = CounterMetricFamily("servewise_server_gc_collections", "Garbage collections of the HTTP server's "
                                "process by generation (2: full)", labels=["generation"])
        s = CounterMetricFamily("servewise_server_gc_pause_seconds", "Time the HTTP server's process spent in "
                                "garbage collections, by generation", labels=["generation"])
        m = GaugeMetricFamily("servewise_server_gc_pause_max_seconds", "The longest garbage collection of the HTTP "
                              "server's process so far, by generation", labels=["generation"])
        for g in range(3):
            n.add_metric([str(g)], self.count[g])
            s.add_metric([str(g)], self.seconds[g])
            m.add_metric([str(g)], self.longest[g])
        yield from (n, s, m)


_gc_pauses: _GcPauses | None = None


def serving_starts() -> None:
    """The longest pause counts from here: the start-up collection (freeze_startup_heap) is not a stall
    of any request."""
    if _gc_pauses is not None:
        _gc_pauses.longest = [0.0] * 3


TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class ServerMetrics:
    def __init__(self, engine, model_name: str = "servewise"):
        global _gc_pauses
        _gc_pauses = _gc_pauses or _GcPauses()
        self.registry = CollectorRegistry()
        self.registry.register(_EngineState(engine))
        self.registry.register(_VllmNames(engine, model_name))
        self.registry.register(_gc_pauses)
        self.model = model_name
        self._vllm_histograms()
        self.requests = Counter("servewise_requests_finished", "Requests by outcome (stop, length, abort, "
                                "rejected: refused for overload, error)", ["outcome"], registry=self.registry)
        self.ttft = Histogram("servewise_time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("servewise_time_per_output_token_seconds", "Mean time per output token after the first",
                              buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
                              registry=self.registry)
        self.e2e = Histogram("servewise_e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.held = Counter("servewise_requests_held_for_restart", "Requests that arrived while the engine was "
                            "being restarted and waited for it (--restart-wait)", registry=self.registry)

    def _vllm_histograms(self) -> None:
        """vLLM's per-request metrics (the names its dashboard reads), labelled by model name."""
        r, m = self.registry, ["model_name"]

        def hist(name, doc, buckets, extra=()):
            return Histogram(name, doc, [*m, *extra], buckets=buckets, registry=r)

        self.v_ttft = hist("vllm:time_to_first_token_seconds", "Time to first token", LATENCY_BUCKETS)
        self.v_tpot = hist("vllm:time_per_output_token_seconds", "Mean time per output token after the first",
                           (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0))
        self.v_e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency", LATENCY_BUCKETS)
        self.v_decode = hist("vllm:request_decode_time_seconds", "Time from the first token to the last",
                             LATENCY_BUCKETS)
        self.v_prompt_len = hist("vllm:request_prompt_tokens", "Prompt tokens per request", TOKEN_BUCKETS)
        self.v_output_len = hist("vllm:request_generation_tokens", "Output tokens per request", TOKEN_BUCKETS)
        self.v_max_output = hist("vllm:request_max_num_generation_tokens", "Output tokens of a request's longest "
                                 "choice (n > 1: several)", TOKEN_BUCKETS)
        self.v_prompt = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests", m, registry=r)
        self.v_output = Counter("vllm:generation_tokens", "Output tokens of finished requests", m, registry=r)
        self.v_success = Counter("vllm:request_success", "Requests finished, by reason (stop, length, abort)",
                                 [*m, "finished_reason"], registry=r)

    def observe(self, req) -> None:
        """A request finished (client.Finished; called from the engine client's thread, and the client
        library is thread-safe)."""
        self.requests.labels(req.finish_reason or "error").inc()
        model = self.model
        self.v_prompt.labels(model).inc(req.num_prompt_tokens)
        self.v_output.labels(model).inc(req.num_output_tokens)
        if req.finish_reason in ("stop", "length", "abort"):
            self.v_success.labels(model, req.finish_reason).inc()
        if req.finish_reason == "abort" or req.first_token_time is None:
            return
        self.v_prompt_len.labels(model).observe(req.num_prompt_tokens)
        self.v_output_len.labels(model).observe(req.num_output_tokens)
        for ours, vllm, v in ((self.ttft, self.v_ttft, req.first_token_time - req.arrival_time),
                              (self.e2e, self.v_e2e, req.finish_time - req.arrival_time)):
            ours.observe(v)
            vllm.labels(model).observe(v)
        self.v_decode.labels(model).observe(req.finish_time - req.first_token_time)
        n = req.num_output_tokens
        if n > 1:
            v = (req.finish_time - req.first_token_time) / (n - 1)
            self.tpot.observe(v)
            self.v_tpot.labels(model).observe(v)

    def completed(self, output_tokens: list[int]) -> None:
        """A request's choices all finished (n of them: each an engine request): the longest one's output."""
        self.v_max_output.labels(self.model).observe(max(output_tokens))

    def rejected(self) -> None:
        self.requests.labels("rejected").inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
