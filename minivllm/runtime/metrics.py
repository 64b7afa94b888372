"""vLLM's Prometheus metrics (`GET /metrics` of `minivllm serve`): what the engine records, and
the text it is rendered to.

The engine keeps plain numbers (EngineMetrics: counters, and histograms as lists of bucket
counts), updated where it already does the work: a request's timestamps when it is queued, first
scheduled, gets its first token and finishes; its tokens' inter-token latencies once a step, not
a token (see LLMEngine._record_token_times). The server takes a snapshot between two steps, on the
engine's thread, and renders it (`render`) as Prometheus' text exposition format 0.0.4, by hand:
no dependency. `families` lists a snapshot's metric families once, for both that text and
LLM.get_metrics() (runtime/metrics_reader.py, vLLM's vllm.v1.metrics.reader dataclasses).

Names, types, labels, buckets and meanings are vLLM v1's (vllm/v1/metrics/loggers.py,
PrometheusStatLogger; vllm/v1/metrics/stats.py). As there, a request with n > 1 completions is
n requests (vLLM runs each as a child request): each completion counts in request_success, the
per-request histograms and prompt_tokens; request_params_n and request_max_num_generation_tokens
count the parent once. Times are the host's monotonic clock, in seconds:
  - TTFT: from the request's arrival (the server's receipt; the engine's enqueue offline) to the
    step that read its first token; e2e: arrival to finish;
  - queue: enqueued to first scheduled; prefill: first scheduled to first token; decode: first to
    last token; inference: first scheduled to last token (preemptions included, as vLLM);
  - inter-token latency: between a completion's consecutive token-reading steps (a speculative
    step's several tokens are one interval, as vLLM's); time per output token: decode time over
    tokens - 1.
Prompt tokens (prompt_tokens_total and its breakdown) count when a request's first token (a
pooling request's result) comes, once, as vLLM's; generation tokens as they are read. A request
without max_tokens observes max_model_len - prompt_len in request_params_max_tokens: the
max_tokens vLLM's input processor gives it. The server, as vLLM's, lowers a default max_tokens
(generation_config's max_new_tokens) past that room to it before queueing, and refuses a
requested one past it (openai_api.fit_context): both observe no more than the room. LLM.generate
checks no max_tokens against the room (nor does vLLM's LLM): one past it is observed as given.
Unlike vLLM 0.13 (issue #31503), a request that ends by an abort (the client left) counts in
request_success{finished_reason="abort"} and the per-request histograms; one that an engine
failure ends counts as "error".
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left

# vLLM's FinishReason, in its order ("repetition" is never given here).
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                         5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's buckets of token counts)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class Histogram:
    """Bucket counts (not cumulative; the last bucket is +Inf), their sum and count. A value v
    falls in the first bucket whose bound is >= v (Prometheus' le)."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds):
        self.bounds = tuple(float(b) for b in bounds)
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError(f"bucket bounds must increase: {bounds}")
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, n: int = 1) -> None:
        """`n` observations of `value`."""
        self.counts[bisect_left(self.bounds, value)] += n
        self.sum += value * n
        self.count += n

    def copy(self) -> "Histogram":
        h = Histogram.__new__(Histogram)
        h.bounds, h.counts, h.sum, h.count = self.bounds, list(self.counts), self.sum, self.count
        return h


class EngineMetrics:
    """What LLMEngine records for vLLM's metrics (the engine's own counts, kept in EngineStats
    and the scheduler, are read at snapshot time)."""

    def __init__(self, max_model_len: int):
        tokens = build_1_2_5_buckets(max_model_len)
        self.max_model_len = max_model_len
        self.request_success = dict.fromkeys(FINISH_REASONS, 0)
        self.prompt_tokens = 0
        self.prompt_tokens_cached = 0
        self.prompt_tokens_recomputed = 0
        self.prompt_tokens_by_source = dict.fromkeys(PROMPT_SOURCES, 0)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(TOKEN_LATENCY_BUCKETS)
        self.tpot = Histogram(TOKEN_LATENCY_BUCKETS)
        self.e2e = Histogram(REQUEST_LATENCY_BUCKETS)
        self.queue = Histogram(REQUEST_LATENCY_BUCKETS)
        self.inference = Histogram(REQUEST_LATENCY_BUCKETS)
        self.prefill = Histogram(REQUEST_LATENCY_BUCKETS)
        self.decode = Histogram(REQUEST_LATENCY_BUCKETS)
        self.prompt_len = Histogram(tokens)
        self.generation_len = Histogram(tokens)
        self.prefill_kv_computed = Histogram(tokens)
        self.max_tokens = Histogram(tokens)
        self.max_generation_len = Histogram(tokens)
        self.n = Histogram(N_BUCKETS)
        self.iteration_tokens = Histogram(ITERATION_TOKENS_BUCKETS)

    def count_prompt(self, seq) -> int:
        """seq's prompt is done (its first token, or its pooled result, came): count its tokens
        by source as vLLM's PromptTokenStats (a cache hit never covers the last token, so a
        prompt found whole but for it has that token "recomputed"). Returns the prompt's
        length."""
        n = seq.prompt_len
        cached = max(seq.num_cached_prompt, 0)
        recomputed = 1 if cached + 1 == n else 0
        self.prompt_tokens += n
        self.prompt_tokens_cached += cached
        self.prompt_tokens_recomputed += recomputed
        by_source = self.prompt_tokens_by_source
        by_source["local_compute"] += n - cached
        by_source["local_cache_hit"] += cached + recomputed
        return n

    def finish_sequence(self, seq, reason: str, now: float, last_token_time: float) -> None:
        """One completion (vLLM: one request, a child of a parent with n > 1) ended at `now`;
        `last_token_time` is when its last token was read (unused without a first token)."""
        self.request_success[reason] = self.request_success.get(reason, 0) + 1
        self.e2e.observe(now - seq.arrival_time)
        generated = 0 if seq.pooling else seq.num_known - seq.prompt_len
        self.prompt_len.observe(seq.prompt_len)
        self.generation_len.observe(generated)
        self.prefill_kv_computed.observe(seq.prompt_len - max(seq.num_cached_prompt, 0))
        if not seq.pooling:
            # vLLM's processor gives a request without max_tokens max_model_len - prompt_len
            # before it is queued: that is the max_tokens its histogram observes.
            max_tokens = seq.params.max_tokens
            if max_tokens is None:
                max_tokens = self.max_model_len - seq.prompt_len
            if max_tokens:
                self.max_tokens.observe(max_tokens)
        scheduled = seq.scheduled_time
        if not scheduled:  # never scheduled: vLLM has no phase times for it
            return
        self.queue.observe(scheduled - seq.queued_time)
        first = seq.first_token_time
        if not first:  # scheduled, no token (an embedding, or aborted while prefilling)
            return
        self.prefill.observe(first - scheduled)
        decode = last_token_time - first
        self.decode.observe(decode)
        self.inference.observe(last_token_time - scheduled)
        if generated > 1:
            self.tpot.observe(decode / (generated - 1))

    def finish_request(self, n: int, max_generated: int) -> None:
        """A parent request (all its n completions) ended: vLLM's request_params_n and
        request_max_num_generation_tokens."""
        self.n.observe(n)
        self.max_generation_len.observe(max_generated)

    def copy(self) -> "EngineMetrics":
        m = EngineMetrics.__new__(EngineMetrics)
        for k, v in vars(self).items():
            setattr(m, k, v if isinstance(v, int) else v.copy())
        return m


# -- the text exposition format 0.0.4 ------------------------------------------------------------

def format_value(v) -> str:
    """A sample's value as Prometheus' Python client writes it (Go's float formatting)."""
    v = float(v)
    if v == math.inf:
        return "+Inf"
    if v == -math.inf:
        return "-Inf"
    if math.isnan(v):
        return "NaN"
    s = repr(v)
    dot = s.find(".")
    if v > 0 and dot > 6:  # Go turns to an exponent from 10**6 on, Python's repr from 10**16
        digits = (s[:dot] + s[dot + 1:]).rstrip("0")
        mantissa = f"{digits[0]}.{digits[1:]}" if len(digits) > 1 else digits
        return f"{mantissa}e+{dot - 1:02d}"
    return s


def escape_label(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _labels(pairs) -> str:
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{escape_label(v)}"' for k, v in pairs) + "}"


class Exposition:
    """Builds the text: families in the order added, each its HELP, TYPE and samples."""

    def __init__(self):
        self.lines: list[str] = []
        self.names: set[str] = set()

    def _family(self, name: str, kind: str, doc: str) -> None:
        if name in self.names:
            raise ValueError(f"metric {name} twice")
        self.names.add(name)
        self.lines.append(f"# HELP {name} {escape_help(doc)}")
        self.lines.append(f"# TYPE {name} {kind}")

    def gauge(self, name: str, doc: str, samples) -> None:
        """samples: (label pairs, value) ..."""
        self._family(name, "gauge", doc)
        for labels, value in samples:
            self.lines.append(f"{name}{_labels(labels)} {format_value(value)}")

    def counter(self, name: str, doc: str, samples) -> None:
        if not name.endswith("_total"):
            raise ValueError(f"a counter's name ends in _total: {name}")
        self._family(name, "counter", doc)
        for labels, value in samples:
            self.lines.append(f"{name}{_labels(labels)} {format_value(value)}")

    def histogram(self, name: str, doc: str, labels, h: Histogram) -> None:
        self._family(name, "histogram", doc)
        labels = list(labels)
        cumulative = 0
        for bound, count in zip((*h.bounds, math.inf), h.counts):
            cumulative += count
            le = format_value(bound)
            self.lines.append(f"{name}_bucket{_labels(labels + [('le', le)])} "
                              f"{format_value(cumulative)}")
        self.lines.append(f"{name}_sum{_labels(labels)} {format_value(h.sum)}")
        self.lines.append(f"{name}_count{_labels(labels)} {format_value(h.count)}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def snapshot(engine) -> dict:
    """The engine's numbers at this moment: call between steps, on the engine's thread (the
    server's EngineLoop.call), so that every histogram is whole."""
    sched, bm = engine.scheduler, engine.block_manager
    return {
        "metrics": engine.metrics.copy() if engine.metrics is not None else None,
        "running": len(sched.running),
        "waiting": len(sched.waiting),
        "kv_cache_usage": 1.0 - bm.num_free / bm.num_blocks,
        "preemptions": sched.num_preemptions,
        "generation_tokens": engine.stats.generation_tokens,
        "prefix_cache_queries": sched.num_prefix_cache_queries,
        "prefix_cache_hits": sched.num_prefix_cache_hits,
        "spec": _spec_snapshot(engine),
        "lora": _lora_snapshot(engine),
        "cache_config": {"block_size": str(engine.config.block_size),
                         "cache_dtype": str(engine.config.cache_dtype),
                         "enable_prefix_caching": str(engine.config.enable_prefix_caching),
                         "num_gpu_blocks": str(engine.num_blocks)},
    }


def _spec_snapshot(engine) -> dict | None:
    """Speculative decoding's counts (EngineStats), None without it: vLLM registers its
    spec-decode metrics only with a speculative config."""
    spec = engine.config.speculative
    if spec is None:
        return None
    stats, k = engine.stats, spec.num_speculative_tokens
    per_pos = stats.spec_accepted_per_pos
    return {"drafts": stats.spec_drafts, "draft_tokens": stats.spec_draft_tokens,
            "accepted": stats.spec_accepted_tokens,
            "per_pos": [per_pos[p] if p < len(per_pos) else 0 for p in range(k)]}


def _lora_snapshot(engine) -> dict | None:
    """With LoRA: max_loras and the adapters of the running and the waiting sequences, by name
    in the scheduler's order, each once (vLLM's lora_requests_info labels); None without."""
    if not engine.config.enable_lora:
        return None

    def names(seqs) -> str:
        seen = dict.fromkeys(engine.lora_names.get(s.lora_id, str(s.lora_id))
                             for s in seqs if s.lora_id)
        return ",".join(seen)

    sched = engine.scheduler
    return {"max_lora": str(engine.config.max_loras), "running": names(sched.running),
            "waiting": names(sched.waiting)}


# Its samples are one Vector in LLM.get_metrics (runtime/metrics_reader.py), as in vLLM's reader.
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


class Family:
    """One metric family of a snapshot: its Prometheus name (a counter's with _total), kind
    ("gauge", "counter" or "histogram"), help text and samples: (label pairs, value) for a
    gauge or counter, (label pairs, Histogram) for a histogram. `families` builds the list that
    both `render` (the /metrics text) and `metric_list` (LLM.get_metrics) read."""

    __slots__ = ("name", "kind", "doc", "samples")

    def __init__(self, name: str, kind: str, doc: str, samples: list):
        self.name, self.kind, self.doc, self.samples = name, kind, doc, samples


def families(snap: dict, model_name: str, engine_index: int = 0) -> list[Family]:
    """vLLM's metric families of a snapshot, in /metrics' order, under the labels model_name and
    engine (vLLM's label names, in its order)."""
    out: list[Family] = []

    def gauge(name, doc, samples):
        out.append(Family(name, "gauge", doc, samples))

    def counter(name, doc, samples):
        out.append(Family(name, "counter", doc, samples))

    base = [("model_name", model_name), ("engine", str(engine_index))]
    m: EngineMetrics | None = snap["metrics"]
    gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
          [([*sorted(snap["cache_config"].items()), ("engine", str(engine_index))], 1)])
    if m is None:  # serve --disable-log-stats: vLLM's logger is off, nothing is recorded
        return out
    gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
          [(base, snap["running"])])
    gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
          [(base, snap["waiting"])])
    gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
          [(base, snap["kv_cache_usage"])])
    counter("vllm:prefix_cache_queries_total",
            "Prefix cache queries, in terms of number of queried tokens.",
            [(base, snap["prefix_cache_queries"])])
    counter("vllm:prefix_cache_hits_total",
            "Prefix cache hits, in terms of number of cached tokens.",
            [(base, snap["prefix_cache_hits"])])
    counter("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.",
            [(base, snap["preemptions"])])
    counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.",
            [(base, m.prompt_tokens)])
    counter("vllm:prompt_tokens_by_source_total", "Number of prompt tokens by source.",
            [(base + [("source", s)], m.prompt_tokens_by_source[s]) for s in PROMPT_SOURCES])
    counter("vllm:prompt_tokens_cached_total",
            "Number of cached prompt tokens (local + external).",
            [(base, m.prompt_tokens_cached)])
    counter("vllm:prompt_tokens_recomputed_total",
            "Number of cached tokens recomputed for forward pass.",
            [(base, m.prompt_tokens_recomputed)])
    counter("vllm:generation_tokens_total", "Number of generation tokens processed.",
            [(base, snap["generation_tokens"])])
    counter("vllm:request_success_total", "Count of successfully processed requests.",
            [(base + [("finished_reason", r)], c) for r, c in m.request_success.items()])
    histograms = [
        ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", m.prompt_len),
        ("vllm:request_generation_tokens", "Number of generation tokens processed.",
         m.generation_len),
        ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
         m.iteration_tokens),
        ("vllm:request_max_num_generation_tokens",
         "Histogram of maximum number of requested generation tokens.", m.max_generation_len),
        ("vllm:request_params_n", "Histogram of the n request parameter.", m.n),
        ("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
         m.max_tokens),
        ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
         m.ttft),
        ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
         m.itl),
        ("vllm:request_time_per_output_token_seconds",
         "Histogram of time_per_output_token_seconds per request.", m.tpot),
        ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
         m.e2e),
        ("vllm:request_queue_time_seconds",
         "Histogram of time spent in WAITING phase for request.", m.queue),
        ("vllm:request_inference_time_seconds",
         "Histogram of time spent in RUNNING phase for request.", m.inference),
        ("vllm:request_prefill_time_seconds",
         "Histogram of time spent in PREFILL phase for request.", m.prefill),
        ("vllm:request_decode_time_seconds",
         "Histogram of time spent in DECODE phase for request.", m.decode),
        ("vllm:request_prefill_kv_computed_tokens",
         "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
         m.prefill_kv_computed),
    ]
    for name, doc, h in histograms:
        out.append(Family(name, "histogram", doc, [(base, h)]))
    spec = snap.get("spec")
    if spec is not None:
        counter("vllm:spec_decode_num_drafts_total", "Number of spec decoding drafts.",
                [(base, spec["drafts"])])
        counter("vllm:spec_decode_num_draft_tokens_total", "Number of draft tokens.",
                [(base, spec["draft_tokens"])])
        counter("vllm:spec_decode_num_accepted_tokens_total", "Number of accepted tokens.",
                [(base, spec["accepted"])])
        counter(PER_POS, "Accepted tokens per draft position.",
                [(base + [("position", str(p))], n) for p, n in enumerate(spec["per_pos"])])
    lora = snap.get("lora")
    if lora is not None:
        # vLLM's labels (no model or engine label) and value: the time of the update, as
        # prometheus_client's set_to_current_time; one sample, this scrape's adapters.
        gauge("vllm:lora_requests_info", "Running stats on lora requests.",
              [([("max_lora", lora["max_lora"]), ("waiting_lora_adapters", lora["waiting"]),
                 ("running_lora_adapters", lora["running"])], time.time())])
    return out


def render(snap: dict, model_name: str, engine_index: int = 0) -> str:
    """Prometheus' text format of a snapshot (`families`)."""
    out = Exposition()
    for f in families(snap, model_name, engine_index):
        if f.kind == "histogram":
            for labels, h in f.samples:
                out.histogram(f.name, f.doc, labels, h)
        else:
            getattr(out, f.kind)(f.name, f.doc, f.samples)
    return out.text()
