"""Prometheus exporter (the only importer of prometheus_client): vLLM's metric names with a `pagedllm:` prefix and
a `model_name` label, and those vLLM has under its own `vllm:` prefix too (the same samples), which routers and
gateways read by default. Each server has its own registry (no process-global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.outputs import IterationStats, SchedulerStats

LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0]
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000]
FINISH_REASONS = ("stop", "length", "abort", "error", "overloaded")


# the metrics vLLM exports under these names (``vllm:`` + name): llm-d's endpoint picker scores replicas by the
# queue and KV-cache gauges, dashboards built for vLLM read the rest
VLLM_NAMES = frozenset({
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens", "generation_tokens",
    "num_preemptions", "prefix_cache_queries", "prefix_cache_hits", "request_success", "time_to_first_token_seconds",
    "inter_token_latency_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
    "request_prompt_tokens", "request_generation_tokens", "iteration_tokens_total", "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos"})


class _VLLMNames:
    """A collector of the ``pagedllm:`` families in ``VLLM_NAMES`` renamed ``vllm:``, read from ``source`` at each
    scrape (one set of values, two names)."""

    def __init__(self, source: CollectorRegistry) -> None:
        self.source = source

    def collect(self):
        for fam in self.source.collect():
            name = fam.name.removeprefix("pagedllm:")
            if name == fam.name or name not in VLLM_NAMES:
                continue
            out = Metric("vllm:" + name, fam.documentation, fam.type, fam.unit)
            out.samples = [s._replace(name="vllm:" + s.name.removeprefix("pagedllm:")) for s in fam.samples]
            yield out


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self):
        return self.families


def merge_expositions(texts: dict[str, str], label: str) -> bytes:
    """Several servers' /metrics texts as one exposition: each family once, each sample labelled ``label`` = the
    key of the text it came from (a data-parallel balancer's view of its replicas)."""
    merged: dict[str, Metric] = {}
    for key, text in texts.items():
        for fam in text_string_to_metric_families(text):
            out = merged.get(fam.name)
            if out is None:
                out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            out.samples.extend(s._replace(labels={**s.labels, label: key}) for s in fam.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry)


class PrometheusStatLogger:
    def __init__(self, model_name: str, kv_capacity_bytes: int = 0, kv_capacity_tokens: int = 0,
                 kv_bytes_per_block: int = 0) -> None:
        self.registry = CollectorRegistry()
        r, lbl = self.registry, ["model_name"]

        def gauge(name, doc):
            return Gauge(f"pagedllm:{name}", doc, lbl, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(f"pagedllm:{name}", doc, lbl, registry=r).labels(model_name)

        def hist(name, doc, buckets):
            return Histogram(f"pagedllm:{name}", doc, lbl, buckets=buckets, registry=r).labels(model_name)

        ProcessCollector(registry=r)  # process_resident_memory_bytes, open fds, CPU seconds (leak checks)
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).")
        self.kv_free_blocks = gauge("kv_cache_free_blocks", "KV cache blocks free (cached prefix blocks count as "
                                    "free); equals kv_cache_total_blocks when no request holds any.")
        self.kv_total_blocks = gauge("kv_cache_total_blocks", "KV cache blocks in the pool.")
        self.state_slots = gauge("recurrent_state_slots", "Recurrent-state slots of a hybrid model's linear layers "
                                 "(0: none); each running request holds one.")
        self.state_held = gauge("recurrent_state_slots_in_use", "Recurrent-state slots held by running requests.")
        self.state_snapshots = gauge("recurrent_state_snapshots", "Free recurrent-state slots keeping a prefix's "
                                     "state for prefix-cache hits.")
        gauge("kv_cache_capacity_bytes", "Bytes preallocated for the paged KV cache.").set(kv_capacity_bytes)
        gauge("kv_cache_capacity_tokens", "Tokens the paged KV cache holds.").set(kv_capacity_tokens)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self._preempt = Counter("pagedllm:num_preemptions", "Requests preempted, by mode.", ["model_name", "mode"],
                                registry=r)
        self.preempt = {m: self._preempt.labels(model_name, m) for m in ("recompute", "swap")}
        self.swapped = gauge("num_requests_swapped", "Requests waiting with their KV swapped to host memory.")
        self.swap_out_bytes = counter("swap_out_bytes", "KV bytes copied to host memory.")
        self.swap_in_bytes = counter("swap_in_bytes", "KV bytes copied back from host memory.")
        self._bytes_per_block = kv_bytes_per_block
        self._last_swap = (0, 0, 0)
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self._success = Counter("pagedllm:request_success", "Finished requests by reason.",
                                ["model_name", "finished_reason"], registry=r)
        self.success = {fr: self._success.labels(model_name, fr) for fr in FINISH_REASONS}
        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive tokens.", LATENCY_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.", LATENCY_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "Time waiting before first scheduled.", LATENCY_BUCKETS)
        self.req_prompt = hist("request_prompt_tokens", "Prompt length of finished requests.", TOKEN_BUCKETS)
        self.req_gen = hist("request_generation_tokens", "Generated tokens of finished requests.", TOKEN_BUCKETS)
        self.iteration_tokens = hist("iteration_tokens_total", "Tokens computed per engine step.", TOKEN_BUCKETS)
        self.spec_drafts = counter("spec_decode_num_drafts", "Draft proposals verified.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._spec_pos = Counter("pagedllm:spec_decode_num_accepted_tokens_per_pos", "Accepted drafts by position.",
                                 ["model_name", "position"], registry=r)
        self._model_name = model_name
        self.circuit_state = gauge("circuit_state", "Primary model circuit breaker: 0 closed, 1 open, 2 half-open.")
        self._last_spec = (0, 0, 0)
        self._last_pos: list[int] = []
        self._last_preemptions = 0
        self._last_queries = 0
        self._last_hits = 0
        self._vllm = CollectorRegistry()
        self._vllm.register(_VLLMNames(self.registry))

    def record(self, s: SchedulerStats, it: IterationStats) -> None:
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.kv_usage.set(s.kv_cache_usage)
        self.kv_free_blocks.set(s.num_free_blocks)
        self.kv_total_blocks.set(s.num_blocks)
        self.state_slots.set(s.num_state_slots)
        self.state_held.set(s.num_state_slots_held)
        self.state_snapshots.set(s.num_state_snapshots)
        rec, swp, sout, sin = (s.num_preemptions_recompute, s.num_preemptions_swap, s.swap_out_blocks,
                               s.swap_in_blocks)
        last_swp, last_out, last_in = self._last_swap
        last_rec = self._last_preemptions - last_swp
        if rec > last_rec:
            self.preempt["recompute"].inc(rec - last_rec)
        if swp > last_swp:
            self.preempt["swap"].inc(swp - last_swp)
        if sout > last_out:
            self.swap_out_bytes.inc((sout - last_out) * self._bytes_per_block)
        if sin > last_in:
            self.swap_in_bytes.inc((sin - last_in) * self._bytes_per_block)
        self._last_swap = (swp, sout, sin)
        self.swapped.set(s.num_swapped)
        self.prefix_queries.inc(max(s.prefix_cache_queries - self._last_queries, 0))
        self.prefix_hits.inc(max(s.prefix_cache_hits - self._last_hits, 0))
        self._last_preemptions, self._last_queries, self._last_hits = (
            s.num_preemptions, s.prefix_cache_queries, s.prefix_cache_hits)
        spec = (s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens)
        for c, now, before in zip((self.spec_drafts, self.spec_draft_tokens, self.spec_accepted), spec, self._last_spec):
            if now > before:
                c.inc(now - before)
        self._last_spec = spec
        for i, v in enumerate(s.spec_accepted_per_pos):
            prev = self._last_pos[i] if i < len(self._last_pos) else 0
            if v > prev:
                self._spec_pos.labels(self._model_name, str(i)).inc(v - prev)
        self._last_pos = list(s.spec_accepted_per_pos)
        if it.num_prompt_tokens:
            self.prompt_tokens.inc(it.num_prompt_tokens)
        if it.num_generation_tokens:
            self.generation_tokens.inc(it.num_generation_tokens)
            self.iteration_tokens.observe(s.num_batched_tokens)
        for v in it.time_to_first_tokens:
            self.ttft.observe(v)
        for v in it.inter_token_latencies:
            self.itl.observe(v)
        for f in it.finished:
            self.success[f.finish_reason].inc()
            self.e2e.observe(f.e2e_latency)
            self.queue_time.observe(f.queue_time)
            self.req_prompt.observe(f.num_prompt_tokens)
            self.req_gen.observe(f.num_generation_tokens)

    def set_circuit_state(self, code: int) -> None:
        self.circuit_state.set(code)

    def render(self) -> bytes:
        return generate_latest(self.registry) + generate_latest(self._vllm)
