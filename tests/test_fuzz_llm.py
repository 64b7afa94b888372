"""Property-based fuzzing of the Python API: SamplingParams(...) and LLM.generate / LLM.chat with
arguments that mix valid values with wrong types (bools for ints, floats for ints, strings, numpy
and torch scalars, tensors, sets), out-of-range and non-finite numbers and odd prompts. Whatever
the arguments, the call either raises ValueError / TypeError before any work (the engine's
queues, blocks and KV cache unchanged) or returns normal outputs; either way a fixed greedy
request's output afterwards is what it was before. FUZZ_EXAMPLES=N runs N examples."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from minivllm import SamplingParams
from minivllm.runtime.demo import ensure_demo_model
from minivllm.runtime.sampling_params import StructuredOutputsParams

from engine_helpers import make_llm
from test_fuzz_server import EXPLODING_SCHEMA, OBJECT, regexes, schema

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "60"))
FUZZ = settings(deadline=None, max_examples=EXAMPLES, derandomize=not os.environ.get("FUZZ_EXAMPLES"),
                suppress_health_check=list(HealthCheck), print_blob=True)
MAX_MODEL_LEN = 64
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
FIXED = "The quick brown fox"


@pytest.fixture(scope="module")
def llm(tmp_path_factory, device):
    path = ensure_demo_model(str(tmp_path_factory.mktemp("demo") / "model"))
    return make_llm(path, device, max_model_len=MAX_MODEL_LEN, num_kv_blocks=12)


@pytest.fixture(scope="module")
def baseline(llm):
    return llm.generate(FIXED, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def snapshot(llm):
    e = llm.engine
    bm = e.block_manager
    return dict(free=sorted(bm.free), requests=len(e.requests), waiting=len(e.scheduler.waiting),
                running=len(e.scheduler.running), k=[t.clone() for t in e.runner.cache.k])


def unchanged(llm, before) -> bool:
    after = snapshot(llm)
    k_before, k_after = before.pop("k"), after.pop("k")
    return after == before and all(torch.equal(a, b) for a, b in zip(k_before, k_after))


odd = st.one_of(st.none(), st.booleans(), st.text(max_size=3), st.just([1]), st.just({1: 2}),
                st.just({1, 2}), st.just(b"1"), st.just(object()),
                st.floats(allow_nan=True, allow_infinity=True))


def py_ints(lo, hi):
    return st.one_of(st.integers(lo, hi), st.integers(lo, hi), st.integers(lo, hi),
                     st.integers(lo, hi).map(np.int64), st.integers(lo, hi).map(torch.tensor),
                     st.integers(lo, hi).map(lambda i: torch.tensor([i])),
                     st.integers(lo, hi).map(float),
                     st.sampled_from([-1, 0, 2**63, -2**63 - 1, 10**30, True, np.bool_(True)]), odd)


def py_reals(lo, hi):
    return st.one_of(st.floats(lo, hi), st.floats(lo, hi), st.floats(lo, hi),
                     st.floats(lo, hi).map(np.float32), st.floats(lo, hi).map(torch.tensor),
                     st.integers(int(lo), int(hi)), st.sampled_from([1e-6, 3.5e38, 10**400]), odd)


ids = st.lists(st.one_of(st.integers(0, 600), st.integers(-3, -1), st.just(True),
                         st.just(2.0), st.just(np.int32(7))), max_size=4)
ids_or_odd = st.one_of(ids, ids, ids.map(tuple), ids.map(np.array), odd)
texts = st.one_of(st.text(max_size=8), st.sampled_from(["", " ", "<|im_end|>", "\ud800"]))

structured = st.one_of(st.fixed_dictionaries({}, optional={
    "json": st.one_of(schema, st.just(EXPLODING_SCHEMA)), "regex": regexes,
    "choice": st.one_of(st.lists(texts, max_size=3), odd), "json_object": odd,
    "grammar": odd}))

PARAMS = {
    "n": py_ints(-1, 3), "temperature": py_reals(-1, 3), "top_p": py_reals(-0.5, 1.5),
    "top_k": py_ints(-2, 600), "min_p": py_reals(-0.5, 1.5),
    "presence_penalty": py_reals(-3, 3), "frequency_penalty": py_reals(-3, 3),
    "repetition_penalty": py_reals(-1, 3), "seed": py_ints(-5, 2**40),
    "stop": st.one_of(texts, st.lists(texts, max_size=2), st.lists(texts).map(tuple), odd),
    "stop_token_ids": ids_or_odd, "ignore_eos": st.one_of(st.booleans(), odd),
    "max_tokens": py_ints(-1, 10), "min_tokens": py_ints(-1, 8),
    "logprobs": py_ints(-2, 25), "prompt_logprobs": py_ints(-2, 25),
    "detokenize": st.one_of(st.booleans(), odd),
    "skip_special_tokens": st.one_of(st.booleans(), odd),
    "include_stop_str_in_output": st.one_of(st.booleans(), odd),
    "truncate_prompt_tokens": py_ints(-2, 80),
    "logit_bias": st.one_of(st.dictionaries(st.one_of(st.integers(-2, 600), st.just("1"),
                                                      st.just(np.int64(3)), st.just(1.0)),
                                            py_reals(-1e3, 1e3), max_size=3), odd),
    "allowed_token_ids": ids_or_odd,
    "bad_words": st.one_of(st.lists(texts, max_size=2), texts, odd),
    "structured_outputs": structured,
}

prompts = st.one_of(
    texts, st.lists(texts, max_size=3),
    ids.map(lambda i: {"prompt_token_ids": i}),
    st.lists(st.integers(1, 300), min_size=MAX_MODEL_LEN - 2, max_size=MAX_MODEL_LEN + 1).map(
        lambda i: {"prompt_token_ids": i}),
    st.fixed_dictionaries({"prompt": texts}, optional={"prompt_token_ids": ids_or_odd,
                                                       "extra": odd}),
    ids, odd)


@st.composite
def calls(draw):
    """(what, kwargs of SamplingParams, the call's other arguments)."""
    keys = draw(st.sets(st.sampled_from(sorted(PARAMS)), max_size=5))
    kwargs = {k: draw(PARAMS[k]) for k in sorted(keys)}
    if "structured_outputs" in kwargs:
        kwargs["structured_outputs"] = draw(st.one_of(
            st.just(kwargs["structured_outputs"]), st.just("regex")))
    what = draw(st.sampled_from(["generate", "generate", "chat", "stream"]))
    if what == "chat":
        message = st.one_of(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                                   "content": texts}), odd)
        arg = draw(st.one_of(st.lists(message, max_size=3),
                             st.lists(st.lists(message, min_size=1, max_size=2), max_size=2), odd))
    else:
        arg = draw(prompts)
    return what, kwargs, arg


def _structured(kwargs):
    """kwargs with a dict structured_outputs made a StructuredOutputsParams (which checks it)."""
    so = kwargs.get("structured_outputs")
    if isinstance(so, dict):
        kwargs = {**kwargs, "structured_outputs": StructuredOutputsParams(**so)}
    return kwargs


def _log(line: str) -> None:
    if os.environ.get("FUZZ_LOG"):  # while hunting: what the examples came to
        with open(os.environ["FUZZ_LOG"], "a") as f:
            f.write(line.replace("\n", " ") + "\n")


@FUZZ
@given(calls())
@example(("generate", {"structured_outputs": {"json": EXPLODING_SCHEMA}}, "x"))
@example(("generate", {"structured_outputs": {"json": {**OBJECT, "required": 5}}}, "x"))
def test_fuzzed_calls_raise_before_work_or_complete(llm, baseline, call):
    what, kwargs, arg = call
    before = snapshot(llm)
    try:
        params = SamplingParams(**_structured(kwargs))
        if what == "chat":
            outs = llm.chat(arg, params, use_tqdm=False)
        elif what == "stream":
            outs = list(llm.stream(arg, params))
        else:
            outs = llm.generate(arg, params, use_tqdm=False)
    except (ValueError, TypeError) as e:
        _log(f"{type(e).__name__}: {str(e)[:60]}")
        assert unchanged(llm, before), "a refused call changed the engine"
    else:
        _log(f"ok {what}")
        assert outs and all(o.finished for o in outs if what != "stream")
        e = llm.engine
        assert not e.requests and not e.scheduler.waiting and not e.scheduler.running
    assert llm.generate(FIXED, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == baseline


@pytest.mark.parametrize("json_schema, match", [
    # The fuzzing's findings: a schema whose regex grows as the product of its nested properties
    # was built and parsed for seconds to minutes (and at more levels ran out of memory), and
    # malformed required / $defs raised a TypeError naming no field ("'int' object is not
    # iterable", "'list' object is not a mapping").
    (EXPLODING_SCHEMA, "regex is too large"),
    ({**OBJECT, "required": 5}, "required must be a list of property names"),
    ({**OBJECT, "required": [["a"]]}, "required must be a list of property names"),
    ({"type": "integer", "$defs": "x"}, r"\$defs must be an object"),
    ({"type": "integer", "definitions": [1]}, "definitions must be an object"),
])
def test_bad_json_schemas_are_named(json_schema, match):
    import time

    start = time.perf_counter()
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(json=json_schema)
    assert time.perf_counter() - start < 5
    with pytest.raises(ValueError, match="regex is too large"):
        StructuredOutputsParams(regex="a" * 300_000)
