"""vLLM's Prometheus metrics (GET /metrics, runtime/metrics.py): the text format checked by a
strict parser written here (prometheus_client is not installed), the server's counters against
what the requests' own responses and the tokenizer say, histogram invariants, gauges, prefix
cache hits, aborts and engine failures; the engine's gauges, preemptions and embeddings
directly."""

from __future__ import annotations

import json
import math
import re
import socket
import time
import urllib.request

import pytest

from minivllm import SamplingParams
from minivllm.runtime import metrics as prom
from minivllm.runtime.pooling import PoolingParams
from minivllm.runtime.server import OpenAIServer

from engine_helpers import make_llm, serving
from test_server import model_dir, post, stream, url  # noqa: F401  (model_dir: a fixture)

NAME = 'tiny "q"\\x'  # label escaping end to end
LABELS = {"model_name": NAME, "engine": "0"}

# -- a strict parser of the text exposition format 0.0.4 ------------------------------------------

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(rf"^({_NAME})(\{{(.*)\}})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\[\\"n])*)"(,|$)')


def _unescape(v: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "\\": "\\", '"': '"'}[m.group(1)], v)


def _float(s: str) -> float:
    assert re.fullmatch(r"[+-]Inf|NaN|-?\d+(\.\d+)?(e[+-]\d+)?", s), s
    return float(s.replace("Inf", "inf"))


def parse(text: str) -> dict:
    """{family: {"type", "help", "samples": [(name, labels, value)]}}; AssertionError on
    anything the format does not allow (a sample before its TYPE or of another family, a family
    twice, bad escapes), and unless each histogram's buckets rise with +Inf last, their counts
    are cumulative, and _count equals the +Inf bucket."""
    assert text.endswith("\n")
    families: dict[str, dict] = {}
    current = None
    for line in text[:-1].split("\n"):
        if line.startswith("# HELP "):
            name, _, doc = line[7:].partition(" ")
            assert name not in families, f"{name} twice"
            assert re.fullmatch(r"(?:[^\\\n]|\\[\\n])*", doc), doc  # escapes: \\ and \n
            families[name] = current = {"help": doc, "type": None, "samples": []}
            current["name"] = name
        elif line.startswith("# TYPE "):
            name, kind = line[7:].split(" ")
            assert current is not None and current["name"] == name and current["type"] is None
            assert kind in ("counter", "gauge", "histogram")
            current["type"] = kind
        else:
            m = _SAMPLE.match(line)
            assert m and current is not None and current["type"] is not None, line
            name, _, body, value = m.groups()
            labels = {}
            if body:
                pos = 0
                while pos < len(body):
                    lm = _LABEL.match(body, pos)
                    assert lm, f"bad labels in {line!r}"
                    assert lm.group(1) not in labels
                    labels[lm.group(1)] = _unescape(lm.group(2))
                    pos = lm.end()
            family = current["name"]
            allowed = {family} if current["type"] != "histogram" else \
                {family + s for s in ("_bucket", "_sum", "_count")}
            assert name in allowed, f"{name} in family {family}"
            if current["type"] == "counter":
                assert family.endswith("_total")
            current["samples"].append((name, labels, _float(value)))
    for family, f in families.items():
        assert f["type"] is not None
        if f["type"] == "histogram":
            buckets = [(s[1]["le"], s[2]) for s in f["samples"] if s[0].endswith("_bucket")]
            assert buckets and buckets[-1][0] == "+Inf"
            bounds = [_float(le) for le, _ in buckets]
            assert bounds == sorted(bounds) and len(set(bounds)) == len(bounds)
            counts = [c for _, c in buckets]
            assert counts == sorted(counts), f"{family}: buckets not cumulative"
            count = [s[2] for s in f["samples"] if s[0] == family + "_count"]
            assert count == [counts[-1]]
    return families


def value(families, name, **labels):
    """The one sample `name` (a family's sample name) with these labels (and LABELS')."""
    family = re.sub(r"_(bucket|sum|count)$", "", name)
    f = families.get(family) or families[name]
    want = {**LABELS, **labels}
    hits = [v for n, lab, v in f["samples"]
            if n == name and all(lab.get(k) == v for k, v in want.items())]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


def scrape(server) -> dict:
    with urllib.request.urlopen(url(server, "/metrics"), timeout=60) as r:
        assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        return parse(r.read().decode())


# -- the format ---------------------------------------------------------------------------------

def test_the_text_format_escapes_orders_and_accumulates():
    h = prom.Histogram([0.5, 1, 2.5])
    for v in (0.1, 0.5, 0.7, 3.0, 100.0):
        h.observe(v)
    h.observe(2.0, n=3)
    out = prom.Exposition()
    out.gauge("a:g", 'help with \\ and\nnewline', [([("x", 'q"uo\\te\nnl')], 1.5)])
    out.counter("a:c_total", "c", [([("k", "1")], 10**6), ([("k", "2")], 7)])
    out.histogram("a:h", "h", [("model_name", "m")], h)
    text = out.text()
    assert '# HELP a:g help with \\\\ and\\nnewline\n' in text
    assert 'a:g{x="q\\"uo\\\\te\\nnl"} 1.5\n' in text
    assert 'a:c_total{k="1"} 1e+06\n' in text and "# TYPE a:c_total counter\n" in text
    lines = [ln for ln in text.split("\n") if ln.startswith("a:h_bucket")]
    assert lines == ['a:h_bucket{model_name="m",le="0.5"} 2.0',
                     'a:h_bucket{model_name="m",le="1.0"} 3.0',
                     'a:h_bucket{model_name="m",le="2.5"} 6.0',
                     'a:h_bucket{model_name="m",le="+Inf"} 8.0']
    fams = parse(text)
    assert fams["a:g"]["samples"] == [("a:g", {"x": 'q"uo\\te\nnl'}, 1.5)]
    assert [s[2] for s in fams["a:h"]["samples"][-2:]] == \
        [pytest.approx(0.1 + 0.5 + 0.7 + 3 + 100 + 6), 8]
    assert (prom.format_value(math.inf), prom.format_value(3), prom.format_value(1234567.0),
            prom.format_value(0.25)) == ("+Inf", "3.0", "1.234567e+06", "0.25")
    assert prom.build_1_2_5_buckets(1024) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    with pytest.raises(ValueError):
        out.counter("a:no_suffix", "c", [])
    with pytest.raises(ValueError):
        out.gauge("a:g", "again", [])
    for bad in ('a{x="1"} 1\n', '# HELP a a\n# TYPE a gauge\na{x="\\q"} 1\n',
                '# HELP a a\n# TYPE a histogram\na_bucket{le="1.0"} 2.0\na_bucket{le="+Inf"} 1.0\n'
                'a_count 1.0\n'):
        with pytest.raises(AssertionError):
            parse(bad)


# -- the server ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(model_dir, device):  # noqa: F811
    srv = OpenAIServer(make_llm(model_dir, device, max_model_len=1024), port=0, model_name=NAME)
    with serving(srv):
        yield srv


def _wait_idle(server):
    deadline = time.time() + 60
    while (server.loop.owners or server.llm.engine.requests) and time.time() < deadline:
        time.sleep(0.02)
    assert not server.loop.owners and not server.llm.engine.requests


def test_the_servers_metrics_count_what_the_requests_got(server):
    tok = server.llm.get_tokenizer()
    fams = scrape(server)
    assert value(fams, "vllm:prompt_tokens_total") == 0  # a fresh server
    assert fams["vllm:request_success_total"]["type"] == "counter"
    assert {s[1]["finished_reason"] for s in fams["vllm:request_success_total"]["samples"]} == \
        {"stop", "length", "abort", "error", "repetition"}
    assert value(fams, "vllm:time_to_first_token_seconds_bucket", le="0.001") == 0
    long_prompt = "one two three four five six seven eight nine ten " * 4
    hits = (len(tok.encode(long_prompt)) - 1) // 16 * 16  # its full blocks but the last token's
    assert hits >= 32
    cases = [  # (body, streamed)
        ({"prompt": "The quick brown fox", "max_tokens": 5, "ignore_eos": True}, False),
        ({"prompt": "Hello, my name is", "max_tokens": 4, "ignore_eos": True}, True),
        ({"prompt": "Once upon a time", "max_tokens": 3, "n": 2, "seed": 3,
          "temperature": 0.9, "ignore_eos": True}, False),
        # Its only allowed id stops it: one token, finish_reason "stop".
        ({"prompt": "Stop right there", "max_tokens": 5, "allowed_token_ids": [7],
          "stop_token_ids": [7]}, False),
        ({"prompt": long_prompt, "max_tokens": 2, "ignore_eos": True}, False),
        ({"prompt": long_prompt, "max_tokens": 2, "ignore_eos": True}, True),
    ]
    prompt_tokens = generated = seqs = 0
    reasons = {"stop": 0, "length": 0}
    queries = 0
    for body, streamed in cases:
        before = scrape(server)
        if streamed:
            events = stream(server, "/v1/completions",
                            {**body, "stream_options": {"include_usage": True}})
            used = events[-1]["usage"]
            finish = [c["finish_reason"] for ev in events for c in ev["choices"]
                      if c["finish_reason"] is not None]
        else:
            status, got = post(server, "/v1/completions", body)
            assert status == 200
            used = got["usage"]
            finish = [c["finish_reason"] for c in got["choices"]]
        after = scrape(server)
        n = body.get("n", 1)
        plen = len(tok.encode(body["prompt"]))
        assert used["prompt_tokens"] == plen
        prompt_tokens += n * plen  # vLLM counts each of n completions as a request
        queries += n * plen
        generated += used["completion_tokens"]
        seqs += n
        for r in finish:
            reasons[r] += 1
        # Each request on its own: its phases inside its end-to-end latency.
        delta = {k: value(after, k) - value(before, k) for k in (
            "vllm:time_to_first_token_seconds_sum", "vllm:e2e_request_latency_seconds_sum",
            "vllm:request_queue_time_seconds_sum", "vllm:request_prefill_time_seconds_sum",
            "vllm:request_decode_time_seconds_sum", "vllm:request_inference_time_seconds_sum",
            "vllm:inter_token_latency_seconds_sum")}
        assert 0 < delta["vllm:time_to_first_token_seconds_sum"] <= \
            delta["vllm:e2e_request_latency_seconds_sum"]
        assert delta["vllm:request_queue_time_seconds_sum"] + \
            delta["vllm:request_inference_time_seconds_sum"] <= \
            delta["vllm:e2e_request_latency_seconds_sum"]
        assert delta["vllm:request_inference_time_seconds_sum"] == pytest.approx(
            delta["vllm:request_prefill_time_seconds_sum"]
            + delta["vllm:request_decode_time_seconds_sum"], abs=1e-9)
        # Latencies observed a step at a time add up to the decode time, a request at a time.
        assert delta["vllm:inter_token_latency_seconds_sum"] == pytest.approx(
            delta["vllm:request_decode_time_seconds_sum"], abs=1e-9)
    assert reasons == {"stop": 1, "length": seqs - 1}
    fams = scrape(server)
    assert value(fams, "vllm:prompt_tokens_total") == prompt_tokens
    assert value(fams, "vllm:generation_tokens_total") == generated
    for r, c in (("stop", 1), ("length", seqs - 1), ("abort", 0), ("error", 0)):
        assert value(fams, "vllm:request_success_total", finished_reason=r) == c
    # The second long prompt found its full blocks in the prefix cache.
    assert value(fams, "vllm:prefix_cache_queries_total") == queries
    assert value(fams, "vllm:prefix_cache_hits_total") == hits
    assert value(fams, "vllm:prompt_tokens_cached_total") == hits
    assert value(fams, "vllm:prompt_tokens_by_source_total", source="local_compute") == \
        prompt_tokens - hits
    assert value(fams, "vllm:request_prefill_kv_computed_tokens_sum") == prompt_tokens - hits
    assert value(fams, "vllm:num_preemptions_total") == 0
    for h in ("e2e_request_latency_seconds", "request_queue_time_seconds",
              "time_to_first_token_seconds", "request_prefill_time_seconds",
              "request_decode_time_seconds", "request_inference_time_seconds",
              "request_prompt_tokens", "request_generation_tokens",
              "request_params_max_tokens"):
        assert value(fams, f"vllm:{h}_count") == seqs, h
        assert value(fams, f"vllm:{h}_sum") > 0, h
    assert value(fams, "vllm:request_prompt_tokens_sum") == prompt_tokens
    assert value(fams, "vllm:request_generation_tokens_sum") == generated
    # One latency per token after each completion's first; time per output token for those
    # with more than one.
    assert value(fams, "vllm:inter_token_latency_seconds_count") == generated - seqs
    assert value(fams, "vllm:request_time_per_output_token_seconds_count") == seqs - 1
    assert value(fams, "vllm:request_params_n_count") == len(cases)
    assert value(fams, "vllm:request_params_n_sum") == seqs
    assert value(fams, "vllm:iteration_tokens_total_sum") == prompt_tokens + generated
    assert value(fams, "vllm:iteration_tokens_total_count") > 0
    # Idle: nothing running or waiting, no block held (cached blocks are free).
    assert value(fams, "vllm:num_requests_running") == 0
    assert value(fams, "vllm:num_requests_waiting") == 0
    assert value(fams, "vllm:kv_cache_usage_perc") == 0
    info = fams["vllm:cache_config_info"]["samples"]
    assert info == [("vllm:cache_config_info", {**info[0][1], "engine": "0"}, 1.0)]
    assert info[0][1]["block_size"] == "16"


def test_an_abandoned_stream_counts_as_an_abort(server):
    tok = server.llm.get_tokenizer()
    _wait_idle(server)
    before = scrape(server)
    prompt = "A client that leaves"
    host, port = server.address
    body = json.dumps({"prompt": prompt, "max_tokens": 1000, "ignore_eos": True,
                       "stream": True}).encode()
    with socket.create_connection((host, port), timeout=60) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        seen = b""
        while b"data: " not in seen:  # streaming has begun: it has its first token
            chunk = s.recv(4096)
            assert chunk
            seen += chunk
        fams = scrape(server)  # while it runs
        assert value(fams, "vllm:num_requests_running") == 1
        assert 0 < value(fams, "vllm:kv_cache_usage_perc") <= 1
    _wait_idle(server)
    after = scrape(server)

    def d(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)
    assert d("vllm:request_success_total", finished_reason="abort") == 1
    assert d("vllm:request_success_total", finished_reason="length") == 0
    assert d("vllm:prompt_tokens_total") == len(tok.encode(prompt))
    gen = d("vllm:generation_tokens_total")
    assert 1 <= gen < 1000
    assert d("vllm:request_generation_tokens_sum") == gen
    assert d("vllm:e2e_request_latency_seconds_count") == 1
    assert d("vllm:time_to_first_token_seconds_count") == 1
    assert d("vllm:inter_token_latency_seconds_count") == gen - 1
    assert d("vllm:inter_token_latency_seconds_sum") == pytest.approx(
        d("vllm:request_decode_time_seconds_sum"), abs=1e-9)
    assert value(after, "vllm:num_requests_running") == 0
    assert value(after, "vllm:kv_cache_usage_perc") == 0


def test_an_engine_failure_counts_as_an_error(server, monkeypatch):
    _wait_idle(server)
    before = scrape(server)
    engine = server.llm.engine
    real, calls = engine.step, []

    def failing(**kw):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return real(**kw)

    monkeypatch.setattr(engine, "step", failing)
    events = stream(server, "/v1/completions", {"prompt": "Fail", "max_tokens": 50,
                                                "ignore_eos": True})
    assert "boom" in events[-1]["error"]["message"]
    monkeypatch.undo()
    after = scrape(server)
    assert value(after, "vllm:request_success_total", finished_reason="error") - \
        value(before, "vllm:request_success_total", finished_reason="error") == 1
    assert value(after, "vllm:num_requests_running") == 0


# -- the engine directly ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(model_dir, device):  # noqa: F811
    # 6 blocks of 16 tokens: three 30-token sequences cannot all grow at once.
    return make_llm(model_dir, device, max_model_len=128, num_kv_blocks=6, max_num_seqs=2)


def _snap(llm):
    return parse(prom.render(prom.snapshot(llm.engine), NAME))


def test_gauges_follow_the_engine_and_preemptions_keep_the_invariants(llm):
    engine = llm.engine
    ids = [[5 + i, 9, 11, 13, 17, 19, 23, 29, 31, 37] for i in range(3)]
    engine.add_requests([{"prompt_token_ids": p} for p in ids],
                        [SamplingParams(max_tokens=40, ignore_eos=True)] * 3)
    fams = _snap(llm)
    assert value(fams, "vllm:num_requests_waiting") == 3
    assert value(fams, "vllm:kv_cache_usage_perc") == 0
    engine.step()
    fams = _snap(llm)
    assert value(fams, "vllm:num_requests_running") == 2  # max_num_seqs
    assert value(fams, "vllm:num_requests_waiting") == 1
    usage = value(fams, "vllm:kv_cache_usage_perc")
    assert usage == pytest.approx(1 - engine.block_manager.num_free / 6) and 0 < usage <= 1
    while engine.has_unfinished_requests():
        engine.step()
    fams = _snap(llm)
    assert engine.scheduler.num_preemptions > 0
    assert value(fams, "vllm:num_preemptions_total") == engine.scheduler.num_preemptions
    assert value(fams, "vllm:request_success_total", finished_reason="length") == 3
    assert value(fams, "vllm:generation_tokens_total") == 120
    assert value(fams, "vllm:prompt_tokens_total") == 30  # once each, recomputes not counted
    assert value(fams, "vllm:inter_token_latency_seconds_count") == 117
    assert value(fams, "vllm:inter_token_latency_seconds_sum") == pytest.approx(
        value(fams, "vllm:request_decode_time_seconds_sum"), abs=1e-9)
    assert value(fams, "vllm:num_requests_running") == 0
    assert value(fams, "vllm:num_requests_waiting") == 0
    assert value(fams, "vllm:kv_cache_usage_perc") == 0


def test_an_embedding_counts_its_prompt_and_ends_as_stop(llm):
    engine = llm.engine
    before = _snap(llm)
    engine.add_pooling_requests([{"prompt_token_ids": [3, 1, 4, 1, 5, 9, 2, 6]}],
                                [PoolingParams()])
    while engine.has_unfinished_requests():
        engine.step()
    after = _snap(llm)

    def d(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)
    assert d("vllm:prompt_tokens_total") == 8
    assert d("vllm:request_success_total", finished_reason="stop") == 1
    assert d("vllm:generation_tokens_total") == 0
    assert d("vllm:time_to_first_token_seconds_count") == 0  # no token, as vLLM
    assert d("vllm:request_prefill_time_seconds_count") == 0
    assert d("vllm:request_queue_time_seconds_count") == 1
    assert d("vllm:e2e_request_latency_seconds_count") == 1
    assert d("vllm:request_generation_tokens_count") == 1
    assert d("vllm:request_generation_tokens_sum") == 0
    assert d("vllm:request_params_max_tokens_count") == 0


def test_without_log_stats_nothing_is_recorded(llm):
    engine = llm.engine
    kept, engine.metrics = engine.metrics, None
    try:
        llm.generate([{"prompt_token_ids": [2, 3, 4]}], SamplingParams(max_tokens=3),
                     use_tqdm=False)
        fams = _snap(llm)
        assert set(fams) == {"vllm:cache_config_info"}
    finally:
        engine.metrics = kept


# -- LLM.get_metrics (vLLM's vllm.v1.metrics.reader) ---------------------------------------------

def reader_view(families) -> list:
    """What vLLM's reader makes of these parsed /metrics families (its get_metrics_snapshot over
    prometheus_client's families, rewritten here over the text): a counter family is named
    without _total, the per-position spec-decode counter is one Vector by position, a
    histogram's buckets keyed by le."""
    from minivllm.metrics import Counter, Gauge, Histogram, Vector
    out = []
    for name, f in families.items():
        if f["type"] == "gauge":
            out += [Gauge(name, lab, v) for _, lab, v in f["samples"]]
        elif f["type"] == "counter":
            short = name[:-len("_total")]
            if short == "vllm:spec_decode_num_accepted_tokens_per_pos":
                by_pos = {int(lab["position"]): int(v) for _, lab, v in f["samples"]}
                rest = {k: v for k, v in f["samples"][0][1].items() if k != "position"}
                out.append(Vector(short, rest, [by_pos[p] for p in range(len(by_pos))]))
            else:
                out += [Counter(short, lab, int(v)) for _, lab, v in f["samples"]]
        else:
            samples = f["samples"]
            buckets = {lab["le"]: int(v) for n, lab, v in samples if n == name + "_bucket"}
            (labels, total), = [(lab, v) for n, lab, v in samples if n == name + "_sum"]
            count, = [int(v) for n, _, v in samples if n == name + "_count"]
            out.append(Histogram(name, labels, count=count, sum=total, buckets=buckets))
    return out


def test_get_metrics_is_the_metrics_text_as_vllms_reader_reads_it(model_dir, device):  # noqa: F811
    from minivllm.metrics import Counter, Gauge, Histogram, Metric, Vector
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1}
    with make_llm(model_dir, device, max_model_len=256, speculative_config=spec) as llm:
        prompts = [{"prompt_token_ids": [5, 6, 7, 8] * 4 + [5, 6]},
                   {"prompt_token_ids": [9, 10, 11] * 5}, {"prompt_token_ids": [3, 1, 4, 1, 5]}]
        llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                               SamplingParams(temperature=0, max_tokens=10, n=2),
                               SamplingParams(temperature=0, max_tokens=1)], use_tqdm=False)
        got = llm.get_metrics()
        name = str(llm.config.model)
        fams = parse(prom.render(prom.snapshot(llm.engine), name))
    assert got == reader_view(fams)  # every family, label set and value
    assert all(type(m) in (Counter, Gauge, Histogram, Vector) and isinstance(m, Metric)
               for m in got)
    by_name = {}
    for m in got:
        by_name.setdefault(m.name, []).append(m)
        assert isinstance(m.labels, dict) and all(isinstance(v, str) for v in m.labels.values())
        if isinstance(m, Counter):
            assert type(m.value) is int and not m.name.endswith("_total")
        elif isinstance(m, Gauge):
            assert type(m.value) is float
        elif isinstance(m, Histogram):
            assert type(m.count) is int and type(m.sum) is float
            assert list(m.buckets)[-1] == "+Inf" and m.buckets["+Inf"] == m.count
            assert all(type(c) is int for c in m.buckets.values())
            assert list(m.buckets.values()) == sorted(m.buckets.values())
    assert {"model_name": name, "engine": "0"} == by_name["vllm:prompt_tokens"][0].labels
    assert by_name["vllm:generation_tokens"][0].value == 24 + 2 * 10 + 1
    assert by_name["vllm:prompt_tokens"][0].value == 18 + 2 * 15 + 5
    assert by_name["vllm:request_success"][0].labels["finished_reason"] == "stop"
    assert sum(c.value for c in by_name["vllm:request_success"]) == 4  # n=2: two requests
    assert by_name["vllm:e2e_request_latency_seconds"][0].count == 4
    assert by_name["vllm:iteration_tokens_total"][0].count > 0  # a histogram keeps _total
    vec, = by_name["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(vec, Vector) and len(vec.values) == 3 and vec.values[0] > 0
    assert vec.labels == {"model_name": name, "engine": "0"}
    assert sum(vec.values) == by_name["vllm:spec_decode_num_accepted_tokens"][0].value
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total" not in by_name
    cache, = by_name["vllm:cache_config_info"]
    assert cache.value == 1.0 and cache.labels["block_size"] == "16"


def test_get_metrics_refuses_without_log_stats(model_dir, device):  # noqa: F811
    with make_llm(model_dir, device, disable_log_stats=True) as llm:
        llm.generate([{"prompt_token_ids": [2, 3, 4]}], SamplingParams(max_tokens=3),
                     use_tqdm=False)
        assert llm.engine.metrics is None
        with pytest.raises(RuntimeError, match="disable_log_stats=False"):
            llm.get_metrics()
        assert set(_snap(llm)) == {"vllm:cache_config_info"}
