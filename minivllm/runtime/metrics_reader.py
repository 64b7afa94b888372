"""LLM.get_metrics()'s metrics: vLLM v1's vllm.v1.metrics.reader (its Metric dataclasses,
get_metrics_snapshot), read from the engine's snapshot (runtime/metrics.py: `families`, the same
list that /metrics renders) instead of prometheus_client's registry.

As vLLM's reader, which reads prometheus_client's families: a counter's name is its family's,
without the _total of its samples ("vllm:prompt_tokens"; a histogram keeps its name whole,
"vllm:iteration_tokens_total"); a histogram's buckets are cumulative, keyed by their le label
("+Inf" last); vllm:spec_decode_num_accepted_tokens_per_pos is one Vector, its values indexed by
the position label. Gauges include vllm:cache_config_info (value 1, the config in its labels) and,
with LoRA, vllm:lora_requests_info, as vLLM registers both as gauges.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import metrics

__all__ = ["Metric", "Counter", "Vector", "Gauge", "Histogram", "get_metrics_snapshot"]


@dataclass
class Metric:
    """A metric of LLM.get_metrics() (vLLM's vllm.v1.metrics.reader.Metric): its name and
    labels. One family's samples of different labels are separate Metrics."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A monotonically increasing integer counter. Named as prometheus_client names a
    counter's family: without the _total of its /metrics sample (vllm:prompt_tokens)."""

    value: int


@dataclass
class Vector(Metric):
    """An ordered array of integer counters: vllm:spec_decode_num_accepted_tokens_per_pos, its
    /metrics samples' values by their position label (which the labels here leave out)."""

    values: list[int]


@dataclass
class Gauge(Metric):
    """A numerical value that can go up or down."""

    value: float


@dataclass
class Histogram(Metric):
    """Observations in buckets: `buckets` maps each bucket's upper bound, as /metrics' le label
    writes it ("0.5", "1.0", ..., "+Inf" last), to the cumulative count of observations up to
    it; `count` is the +Inf bucket's, `sum` the observations' sum."""

    count: int
    sum: float
    buckets: dict[str, int]


def get_metrics_snapshot(snap: dict, model_name: str, engine_index: int = 0) -> list[Metric]:
    """The snapshot's families (metrics.families, what /metrics renders) as vLLM's reader gives them
    (vllm.v1.metrics.reader.get_metrics_snapshot): a Gauge, Counter or Histogram per family and
    set of labels, counters named without _total, the per-position spec-decode counter as one
    Vector."""
    out: list[Metric] = []
    for f in metrics.families(snap, model_name, engine_index):
        if f.kind == "gauge":
            out.extend(Gauge(f.name, dict(labels), float(v)) for labels, v in f.samples)
        elif f.kind == "histogram":
            for labels, h in f.samples:
                buckets, cumulative = {}, 0
                for bound, count in zip((*h.bounds, math.inf), h.counts):
                    cumulative += count
                    buckets[metrics.format_value(bound)] = cumulative
                out.append(Histogram(f.name, dict(labels), count=h.count, sum=float(h.sum),
                                            buckets=buckets))
        elif f.name == metrics.PER_POS:
            name = f.name[:-len("_total")]
            by_labels: dict = {}
            for labels, v in f.samples:
                rest = tuple((k, x) for k, x in labels if k != "position")
                pos = int(dict(labels)["position"])
                by_labels.setdefault(rest, {})[pos] = int(v)
            for rest, by_pos in by_labels.items():
                values = [0] * (max(by_pos) + 1)
                for pos, v in by_pos.items():
                    values[pos] = v
                out.append(Vector(name, dict(rest), values))
        else:
            name = f.name[:-len("_total")]
            out.extend(Counter(name, dict(labels), int(v)) for labels, v in f.samples)
    return out
