"""The dataclasses of LLM.get_metrics() (vLLM's vllm.v1.metrics.reader): Metric, Counter,
Gauge, Histogram, Vector. Defined in runtime/metrics_reader.py."""

from .runtime.metrics_reader import Counter, Gauge, Histogram, Metric, Vector

__all__ = ["Metric", "Counter", "Gauge", "Histogram", "Vector"]
