"""Property-based fuzzing of the OpenAI-compatible server's request handling (runtime/server.py,
runtime/openai_api.py): request bodies that mix valid fields with wrong types, out-of-range
numbers, unknown fields, nested garbage and odd structured-output / tool specs. Whatever the
body, the answer is a 200 or a 4xx with OpenAI's error body (never a 5xx, never a dropped
connection, never an error event mid-stream), and afterwards a fixed greedy request answers
exactly as it did before the first fuzzed one (nothing in the engine or the KV cache changed).

One server for the whole module. FUZZ_EXAMPLES=N runs N examples per test (the default is small
enough for the suite); the @example cases are the bugs found so far."""

from __future__ import annotations

import http.client
import json
import math
import os

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from minivllm.runtime.server import OpenAIServer

from engine_helpers import make_llm, serving
from test_server import model_dir  # noqa: F401  (the fixture: the demo checkpoint, greedy)

NAME = "tiny"
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "60"))
FUZZ = settings(deadline=None, max_examples=EXAMPLES, derandomize=not os.environ.get("FUZZ_EXAMPLES"),
                suppress_health_check=list(HealthCheck), print_blob=True)
MAX_MODEL_LEN = 96

# A schema whose regex doubles at each $ref level: 4 properties x 8 levels is 4^8 copies of the
# innermost one (a pattern of ~3 MB, built in seconds and parsed for longer: one request held
# the server's CPU, and at 12 levels its memory).
EXPLODING_SCHEMA = {"$ref": "#/$defs/d0", "$defs": {
    **{f"d{i}": {"type": "object", "properties": {k: {"$ref": f"#/$defs/d{i + 1}"}
                                                  for k in "abcd"}} for i in range(12)},
    "d12": {"type": "integer"}}}


def _json_schema(schema: dict) -> dict:
    return {"messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                        "schema": schema}}}


OBJECT = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.fixture(scope="module")
def server(model_dir, device):  # noqa: F811
    srv = OpenAIServer(make_llm(model_dir, device, max_model_len=MAX_MODEL_LEN, num_kv_blocks=16),
                       port=0, model_name=NAME)
    with serving(srv):
        yield srv


def request(server, path: str, body) -> tuple[int, str, bytes]:
    """-> (status, content type, raw body); a dropped connection raises."""
    host, port = server.address
    conn = http.client.HTTPConnection(host, port, timeout=120)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.getheader("Content-Type") or "", r.read()
    finally:
        conn.close()


FIXED = [("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0,
                              "ignore_eos": True}),
         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                   "max_tokens": 6, "temperature": 0, "ignore_eos": True})]


def fixed_answers(server) -> list[str]:
    texts = []
    for path, body in FIXED:
        status, _, raw = request(server, path, body)
        assert status == 200, raw
        choice = json.loads(raw)["choices"][0]
        texts.append(choice["text"] if "text" in choice else choice["message"]["content"])
    return texts


@pytest.fixture(scope="module")
def baseline(server):
    return fixed_answers(server)


def check_answer(server, path: str, body) -> None:
    """The fuzz property for one request; the KV cache and queues checked after."""
    status, ctype, raw = request(server, path, body)
    if os.environ.get("FUZZ_LOG"):
        with open(os.environ["FUZZ_LOG"], "a") as f:
            f.write(json.dumps([path, status, raw[:150].decode(errors="replace")]) + "\n")
    assert status == 200 or 400 <= status < 500, (status, raw[:2000])
    if status != 200:
        error = json.loads(raw)["error"]
        assert error["code"] == status and isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str)
        return
    if ctype.startswith("text/event-stream"):
        events = [e[len("data: "):] for e in raw.decode().split("\n\n") if e]
        assert events and events[-1] == "[DONE]", raw[-500:]
        for e in events[:-1]:
            assert "error" not in json.loads(e), e  # the engine failed mid-stream
    else:
        json.loads(raw)


def assert_engine_idle(server) -> None:
    engine = server.llm.engine
    assert not engine.requests and not server.loop.owners
    assert not engine.scheduler.waiting and not engine.scheduler.running


# -- strategies --------------------------------------------------------------------------------

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                      st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8))
garbage = st.recursive(json_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8)


def mostly(valid, *bad):
    """valid values three times in four, else one of `bad` (garbage when none is given): a body
    of several fields must often be all valid to reach the engine."""
    return st.one_of(valid, valid, valid, st.one_of(*bad) if bad else garbage)


def ints(lo=-3, hi=20):
    """An integer field's values: mostly in [lo, hi], else at the edges, huge, or the wrong JSON
    types (bools, floats integral and not, NaN / inf, strings, nested garbage)."""
    return mostly(st.integers(lo, hi), st.sampled_from(
        [0, -1, -2, 2**31, 2**63 - 1, 2**63, -2**63, 10**30, 2.0, 2.5, True, False, "1", 1e300]),
        st.floats(allow_nan=True, allow_infinity=True), garbage)


def reals(lo=-3.0, hi=3.0):
    return mostly(st.one_of(st.floats(lo, hi), st.integers(int(lo), int(hi))), st.sampled_from(
        [0.0, -0.0, 1e-9, 1e300, -1e300, 3.5e38, 10**400, True, "0.5"]),
        st.floats(allow_nan=True, allow_infinity=True), garbage)


def flag():
    return mostly(st.booleans())


token_id = mostly(st.integers(0, 300), st.integers(-5, -1), st.integers(10**3, 10**20),
                  st.booleans(), st.floats(allow_nan=True, allow_infinity=True),
                  st.text(max_size=3))
id_list = st.lists(token_id, max_size=5)
texts = st.one_of(st.text(max_size=12), st.sampled_from(["The quick", "Hello", "", " ", "\x00",
                                                         "<|im_end|>", "<|endoftext|>", "\ud800x"]))

schema = st.recursive(
    st.one_of(st.fixed_dictionaries({"type": st.sampled_from(
        ["string", "integer", "number", "boolean", "null", "object", "array", "date", 5])}),
        st.fixed_dictionaries({"type": st.just("string")}, optional={
            "minLength": ints(0, 5), "maxLength": ints(0, 5), "pattern": st.just("a+")}),
        st.fixed_dictionaries({"enum": st.lists(json_leaf, max_size=3)}),
        st.fixed_dictionaries({"const": garbage}),
        st.fixed_dictionaries({"$ref": st.sampled_from(["#/$defs/a", "#/definitions/a", "x",
                                                        "#/$defs/a/b", 3])}),
        garbage, st.just(EXPLODING_SCHEMA)),
    lambda inner: st.one_of(
        st.fixed_dictionaries({"type": st.just("array")}, optional={
            "items": inner, "minItems": ints(0, 3), "maxItems": ints(0, 3)}),
        st.fixed_dictionaries({"type": st.just("object")}, optional={
            "properties": st.one_of(st.dictionaries(st.text(max_size=4), inner, max_size=3),
                                    garbage),
            "required": st.one_of(st.lists(st.text(max_size=4), max_size=2), garbage),
            "additionalProperties": st.one_of(st.booleans(), inner)}),
        st.fixed_dictionaries({"anyOf": st.lists(inner, max_size=3)}),
        st.fixed_dictionaries({"allOf": st.lists(inner, max_size=2)}),
        st.fixed_dictionaries({"type": st.lists(st.sampled_from(["string", "null", "x"]),
                                                max_size=3)}),
        st.fixed_dictionaries({"$defs": st.one_of(st.dictionaries(st.just("a"), inner),
                                                  garbage),
                               "definitions": garbage, "$ref": st.just("#/$defs/a")})),
    max_leaves=6)

regexes = st.one_of(st.sampled_from(["a+", "[0-9]{1,3}", "(a|b)*c", "(", "a{2,1}", "\\", "",
                                     "a{0,1000000}", "(?=a)", "\\d+", "[^a]", "((((a))))",
                                     "(a{1,30}){1,30}", "x*?", "\\p{L}", "(?i)a", "$^"]),
                    st.text(max_size=10), garbage)

plain_message = st.fixed_dictionaries({
    "role": st.sampled_from(["user", "system", "assistant", "tool"]), "content": texts})
message = st.one_of(
    plain_message, plain_message, plain_message,
    st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "assistant"]), garbage)},
                          optional={"content": st.one_of(
                              texts, st.none(), garbage,
                              st.lists(st.fixed_dictionaries(
                                  {"type": st.sampled_from(["text", "image_url", 1])},
                                  optional={"text": st.one_of(texts, garbage)}), max_size=2)),
                              "name": garbage, "tool_call_id": garbage,
                              "reasoning_content": garbage,
                              "tool_calls": st.one_of(garbage, st.lists(st.fixed_dictionaries(
                                  {"id": texts, "type": st.just("function"),
                                   "function": st.fixed_dictionaries(
                                       {"name": st.one_of(texts, garbage)},
                                       optional={"arguments": st.one_of(
                                           st.sampled_from(['{"a": 1}', "{", "", "[]", "1"]),
                                           garbage)})}), max_size=2))}),
    garbage)

tool = st.one_of(
    st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": st.sampled_from(["f", "g", "", "get weather"])},
        optional={"description": st.one_of(texts, garbage), "parameters": st.one_of(schema, garbage),
                  "strict": garbage})}),
    garbage)

tool_choice = st.one_of(st.sampled_from(["none", "auto", "required", "any", ""]),
                        st.fixed_dictionaries({"type": st.sampled_from(["function", "x"]),
                                               "function": st.one_of(st.fixed_dictionaries(
                                                   {"name": st.sampled_from(["f", "g", "h"])}),
                                                   garbage)}),
                        garbage)

response_format = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema",
                                                    "regex", "yaml", 1])}),
    st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.one_of(
        st.fixed_dictionaries({"name": texts, "schema": schema},
                              optional={"strict": garbage}), garbage)}),
    garbage)

structured = st.one_of(
    st.fixed_dictionaries({}, optional={
        "json": st.one_of(schema, st.text(max_size=6)), "regex": regexes,
        "choice": st.one_of(st.lists(texts, max_size=3), garbage),
        "json_object": garbage, "grammar": garbage, "structural_tag": garbage,
        "whitespace_pattern": garbage}),
    garbage)

COMMON = {
    "model": mostly(st.sampled_from([NAME, "other", ""]), garbage),
    "n": ints(-1, 3), "best_of": ints(-1, 3),
    "temperature": reals(), "top_p": reals(-0.5, 1.5), "top_k": ints(-2, 50),
    "min_p": reals(-0.5, 1.5), "presence_penalty": reals(), "frequency_penalty": reals(),
    "repetition_penalty": reals(-1, 3), "seed": ints(-5, 2**40),
    "stop": mostly(texts, st.lists(texts, max_size=3), garbage),
    "stop_token_ids": mostly(id_list, garbage),
    "ignore_eos": flag(),
    "min_tokens": ints(-1, 8), "max_tokens": ints(-1, 12),
    "logit_bias": mostly(
        st.dictionaries(mostly(st.sampled_from(["1", "-1", "1.5", "x", "", " 2 ", "1_0",
                                                   "99999999999999999999", "٣", "0x10"]),
                                  st.integers(-5, 400).map(str)),
                        reals(-200, 200), max_size=3), garbage),
    "allowed_token_ids": mostly(id_list, garbage),
    "bad_words": mostly(st.lists(texts, max_size=3), garbage),
    "skip_special_tokens": flag(),
    "spaces_between_special_tokens": flag(),
    "include_stop_str_in_output": flag(),
    "truncate_prompt_tokens": ints(-2, 200), "prompt_logprobs": ints(-2, 30),
    "stream": flag(),
    "stream_options": mostly(st.fixed_dictionaries({}, optional={
        "include_usage": flag(),
        "continuous_usage_stats": flag(), "x": garbage}), garbage),
    "structured_outputs": structured,
    "guided_choice": mostly(st.lists(texts, max_size=3), garbage),
    "guided_regex": regexes, "guided_json": mostly(schema, st.text(max_size=8), garbage),
    "response_format": response_format,
    "priority": ints(-1, 1),
    "user": garbage, "metadata": garbage,
}

prompt = st.one_of(texts, st.lists(texts, max_size=3), id_list,
                   st.lists(id_list, max_size=3),
                   st.lists(st.integers(1, 200), min_size=MAX_MODEL_LEN - 2,
                            max_size=MAX_MODEL_LEN + 2),
                   garbage)

COMPLETION = {**COMMON, "prompt": prompt, "echo": flag(),
              "logprobs": ints(-2, 30), "suffix": mostly(texts, garbage),
              "prompt_embeds": garbage}
CHAT = {**COMMON, "messages": mostly(st.lists(message, min_size=1, max_size=3), garbage),
        "max_completion_tokens": ints(-1, 12), "logprobs": flag(),
        "top_logprobs": ints(-2, 30), "add_generation_prompt": flag(),
        "continue_final_message": flag(),
        "chat_template": mostly(st.sampled_from(
            ["{{ messages[0]['content'] }}", "{% for", "{{ raise_exception('no') }}", "",
             "{{ 1/0 }}", "{{ messages[99] }}", "{{ x.y.z }}"]), garbage),
        "chat_template_kwargs": mostly(st.dictionaries(st.sampled_from(
            ["add_generation_prompt", "tools", "enable_thinking", "messages", "tokenize",
             "conversation", "x"]), garbage, max_size=2), garbage),
        "tools": mostly(st.lists(tool, max_size=2), garbage), "tool_choice": tool_choice,
        "include_reasoning": flag(),
        "parallel_tool_calls": flag()}
TOKENIZE = {"model": COMMON["model"], "prompt": mostly(texts, garbage),
            "messages": CHAT["messages"], "add_special_tokens": flag(),
            "add_generation_prompt": CHAT["add_generation_prompt"],
            "continue_final_message": CHAT["continue_final_message"],
            "chat_template": CHAT["chat_template"],
            "chat_template_kwargs": CHAT["chat_template_kwargs"],
            "return_token_strs": flag(), "tools": CHAT["tools"]}
DETOKENIZE = {"model": COMMON["model"], "tokens": mostly(id_list, garbage)}


def bodies(fields: dict, required: dict):
    """Objects of up to 6 of `fields` (each valued by its strategy) over the `required` ones
    (usually valid, else left out or garbage); now and then not an object at all."""
    def body(keys):
        must = {k: mostly(v, st.just(None), garbage) for k, v in required.items()}
        return st.fixed_dictionaries({**must, **{k: fields[k] for k in sorted(keys)}}).map(
            lambda d: {k: v for k, v in d.items() if v is not None or k not in required})

    obj = st.sets(st.sampled_from(sorted(fields)), max_size=6).flatmap(body)
    unknown = st.tuples(obj, st.sampled_from(["bogus", "max_token", "", "prompt "]), garbage).map(
        lambda t: {**t[0], t[1]: t[2]})
    return st.one_of(obj, obj, obj, obj, obj, obj, obj, obj, unknown, garbage)


completion_bodies = bodies(COMPLETION, {"prompt": st.one_of(texts, id_list)})
chat_bodies = bodies(CHAT, {"messages": st.lists(message, min_size=1, max_size=2)})
tokenize_bodies = bodies(TOKENIZE, {})
detokenize_bodies = bodies(DETOKENIZE, {"tokens": id_list})

routed = st.one_of(
    st.tuples(st.just("/v1/completions"), completion_bodies),
    st.tuples(st.just("/v1/chat/completions"), chat_bodies),
    st.tuples(st.sampled_from(["/tokenize"]), tokenize_bodies),
    st.tuples(st.sampled_from(["/detokenize"]), detokenize_bodies),
)


@FUZZ
@given(routed)
@example(("/v1/chat/completions", _json_schema(EXPLODING_SCHEMA)))
@example(("/v1/chat/completions", _json_schema({**OBJECT, "required": 5})))
def test_fuzzed_requests_are_answered_200_or_4xx(server, baseline, case):
    path, body = case
    check_answer(server, path, body)
    assert_engine_idle(server)
    assert fixed_answers(server) == baseline


def test_the_fixed_request_is_unchanged_after_the_fuzzing(server, baseline):
    """Runs after the fuzz test (pytest keeps the file's order): nothing it sent changed the
    engine's answers."""
    assert fixed_answers(server) == baseline


NESTED = {"type": "integer"}  # a tool's parameters 800 arrays deep
for _ in range(800):
    NESTED = {"type": "array", "items": NESTED}
MESSAGES = [{"role": "user", "content": "x"}]
DEEP_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": NESTED}}]


def template_renders_deep_tools(model_dir: str) -> bool:
    """Whether transformers renders the chat template over DEEP_TOOLS at Python's default
    recursion limit (the reference for the server's answer: a 200 where it does)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    try:
        tok.apply_chat_template(MESSAGES, tools=DEEP_TOOLS, tokenize=False,
                                add_generation_prompt=True)
        return True
    except RecursionError:
        return False


@pytest.mark.parametrize("path, body, match", [
    # The bugs the fuzzing found: each was answered after seconds to minutes of CPU (and at more
    # levels the server's memory), or answered 400 with a message about something else
    # ("'response_format' takes choice, regex, json or json_object, got ['json']").
    ("/v1/chat/completions", _json_schema(EXPLODING_SCHEMA), "regex is too large"),
    ("/v1/completions", {"prompt": "x", "guided_json": EXPLODING_SCHEMA}, "regex is too large"),
    ("/v1/chat/completions", _json_schema({**OBJECT, "required": 5}),
     "required must be a list of property names"),
    ("/v1/chat/completions", _json_schema({**OBJECT, "required": [["a"]]}),
     "required must be a list of property names"),
    ("/v1/chat/completions", _json_schema({"type": "integer", "$defs": "x"}),
     r"\$defs must be an object"),
    ("/v1/completions", {"prompt": "x", "guided_json": {"type": "integer", "definitions": [1]}},
     "definitions must be an object"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "a" * 300_000}, "regex is too large"),
    # Found by review (session 57): nesting past the recursion of Python's json decoder or of
    # re's parser was a RecursionError, answered 500.
    ("/v1/completions", b'{"prompt": "x", "a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
     "nests too deep"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "(" * 5000 + ")" * 5000},
     "nested too deep"),
    ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
            # past any version's C recursion limit (3.12 parses 5,000 levels: its limit is 8,000)
            "name": "f", "arguments": "[" * 100_000 + "]" * 100_000}}]}]}, "is not JSON"),
    # within json's depth, past the chat template's: 400 "... nest too deep for the chat
    # template" where transformers' apply_chat_template recurses per level (5.25's
    # _plain_template_data does); a 200 where it renders them (the GPU machine's 5.17 did)
    ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "none", "tools": DEEP_TOOLS},
     "tools nest too deep for the chat template"),
])
def test_fuzz_findings(server, baseline, model_dir, path, body, match):  # noqa: F811
    import re
    import sys

    # Python's default recursion limit, which the nesting cases are sized against: Inductor
    # raises the process's to 2,000 when it compiles, and a compile in an earlier test of the
    # same process let the template render 800 levels (the CI run of session 64).
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    try:
        status, _, raw = request(server, path, body)
        renders = (isinstance(body, dict) and body.get("tools") is DEEP_TOOLS
                   and template_renders_deep_tools(model_dir))
    finally:
        sys.setrecursionlimit(limit)
    if renders:
        assert status == 200 and json.loads(raw)["choices"], (status, raw[:2000])
    else:
        error = json.loads(raw)["error"]
        assert status == 400 and re.search(match, error["message"]), (status, error)
    assert_engine_idle(server)
    assert fixed_answers(server) == baseline
