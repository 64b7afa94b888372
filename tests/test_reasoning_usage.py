"""usage.completion_tokens_details.reasoning_tokens of a chat completion, as current vLLM's
server gives it (vllm-project/vllm PR #45802):
vllm/entrypoints/openai/chat_completion/serving.py (chat_completion_full_generator,
chat_completion_stream_generator: `_include_reasoning_tokens_details = bool(reasoning_parser)`),
vllm/entrypoints/serve/engine/protocol.py (CompletionTokenUsageInfo, UsageInfo) and
vllm/frontend/processing/parser/engine/streaming_parser_engine.py (reasoning_token_count, the
tokens of the REASONING_CHUNK events; vllm/parser/qwen3.py's grammar).

When: with a reasoning parser on every chat usage, 0 where no reasoning came: a whole
response's (every choice's summed), a stream's last usage chunk (summed), and each continuous
usage chunk (its own choice's so far; the role chunks 0). Without a reasoning parser the key is
absent; /v1/completions never has it.
How: the tokens inside the reasoning; the tags bounding it (<think>, </think>, a <think> inside
it too) are not reasoning chunks, and special tokens (EOS) are dropped by vLLM's parser, so
none of those counts. Where the reasoning starts is minivllm's split's (runtime/reasoning.py):
a prompt that opened <think> starts inside it, one that closed it (enable_thinking false) never
in it, one with neither at a first generated <think>.

The oracle: the completions' token ids from the LLM API without a parser (the same seed gives
the same tokens; the server's logprob tokens are checked to be those), counted by position."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from minivllm import SamplingParams
from minivllm.runtime.chat_output import ReasoningTokens
from minivllm.runtime.reasoning import ANSWER, REASONING, UNDECIDED, ThinkTags
from minivllm.runtime.server import OpenAIServer

from engine_helpers import serving
from test_reasoning_tools import USER, ids_of, llm, model_dir, reference, server  # noqa: F401
from test_server import post, stream

USAGE = {"include_usage": True, "continuous_usage_stats": True}
KWARGS = {REASONING: {"thinking": "open"}, ANSWER: {"enable_thinking": False}, UNDECIDED: {}}


def counted(ids: list[int], phase: str, start: int, end: int, eos: int) -> int:
    """vLLM's reasoning tokens of one completion by position: EOS dropped; none where the prompt
    closed the reasoning or, undecided, the first token is not <think> (that <think> is a tag);
    then the tokens before the first </think>, a <think> among them a tag too."""
    ids = [t for t in ids if t != eos]
    if phase == ANSWER:
        return 0
    if ids[:1] == [start]:
        ids = ids[1:]
    elif phase == UNDECIDED:
        return 0
    inside = ids[:ids.index(end)] if end in ids else ids
    return sum(t != start for t in inside)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([7, 8, 9, 3, 4, 5]), max_size=14),
       st.sampled_from([REASONING, ANSWER, UNDECIDED]), st.lists(st.integers(0, 14), max_size=6))
def test_a_counts_pieces_sum_to_the_whole_completions(ids, phase, cuts):
    """Fed in any pieces (a stream's deltas), the count is the whole completion's by position;
    7, 8 are the tags, 9 EOS, a special token (a turn mark)."""
    tokens = ReasoningTokens(phase, ThinkTags(7, 8, frozenset({9})))
    bounds = sorted({0, len(ids), *(min(c, len(ids)) for c in cuts)})
    for a, b in zip(bounds, bounds[1:]):
        tokens.feed(ids[a:b])
        assert tokens.count == counted(ids[:b], phase, 7, 8, 9)
    assert tokens.count == counted(ids, phase, 7, 8, 9)


@pytest.fixture(scope="module")
def plain(reference):  # noqa: F811
    """The same checkpoint served without a reasoning parser."""
    srv = OpenAIServer(reference, port=0, model_name="tiny")
    with serving(srv):
        yield srv


def expected(reference, body: dict, phase: str):  # noqa: F811
    """Each choice's token ids (the LLM API's, seeded as the request) and vLLM's count."""
    start, end, eos = ids_of(reference, "<think>", "</think>", "<|im_end|>")
    params = SamplingParams(n=body["n"], temperature=1.0, seed=body["seed"],
                            max_tokens=body["max_tokens"],
                            logit_bias={int(k): v for k, v in body["logit_bias"].items()})
    outs = reference.chat(USER, params, chat_template_kwargs=KWARGS[phase],
                          use_tqdm=False)[0].outputs
    ids = [list(o.token_ids) for o in outs]
    return ids, [counted(i, phase, start, end, eos) for i in ids]


def tokens_as_tags(reference, ids: list[int]) -> list[str | None]:  # noqa: F811
    """The tags among a completion's tokens (None for the others): the server's logprob tokens
    must have them where the LLM API's ids do."""
    names = dict(zip(ids_of(reference, "<think>", "</think>"), ("<think>", "</think>")))
    return [names.get(t) for t in ids]


def logprob_tags(tokens: list[str]) -> list[str | None]:
    return [t if t in ("<think>", "</think>") else None for t in tokens]


# (phase, seed, bias on <think>, </think>, <|im_end|>, what the seed's tokens must show); n=2,
# 16 tokens at temperature 1, searched on the CPU's sampler.
CASES = {
    # </think> after 1 token in one choice, after 15 in the other; a second </think> in the answer.
    "opened, ended early and late": (REASONING, 6, 0, 2.5, 0, "ended"),
    # No </think>: each choice's 16 tokens are reasoning, cut by max_tokens.
    "opened, cut by max_tokens": (REASONING, 0, 0, 0, 0, "cut"),
    # EOS inside the reasoning: the tokens before it, not EOS.
    "opened, stopped inside": (REASONING, 4, 0, 0, 1.5, "eos"),
    # One choice opens with <think> (reasoning until its </think>), the other does not (none).
    "undecided": (UNDECIDED, 23, 3, 2.5, 0, "opens"),
    # A <think> inside the reasoning: a tag, not counted.
    "undecided, a <think> inside": (UNDECIDED, 19, 3, 2.5, 0, "inner"),
    # The prompt closed it: tags in the answer count nothing.
    "closed": (ANSWER, 6, 2, 2.5, 0, "tags"),
}


def shows(ids: list[list[int]], what: str, start: int, end: int, eos: int) -> bool:
    """Whether the seed's completions show the case's point (else the case tests less)."""
    if what == "ended":
        return any(end in i[1:-1] for i in ids)
    if what == "cut":
        return all(len(i) == 16 and end not in i and eos not in i for i in ids)
    if what == "eos":
        return any(i[-1] == eos and end not in i for i in ids)
    if what == "opens":
        return {i[0] == start for i in ids} == {True, False} and any(end in i for i in ids)
    if what == "inner":
        return any(i[0] == start and start in i[1:i.index(end) if end in i else None]
                   for i in ids)
    return any(start in i or end in i for i in ids)


@pytest.mark.parametrize("case", list(CASES))
def test_reasoning_tokens_are_vllms_count(server, reference, case):  # noqa: F811
    phase, seed, bias_start, bias_end, bias_eos, what = CASES[case]
    start, end, eos = ids_of(reference, "<think>", "</think>", "<|im_end|>")
    body = {"messages": USER, "n": 2, "max_tokens": 16, "temperature": 1.0, "seed": seed,
            "logprobs": True, "chat_template_kwargs": KWARGS[phase],
            "logit_bias": {str(start): bias_start, str(end): bias_end, str(eos): bias_eos}}
    ids, want = expected(reference, body, phase)
    assert shows(ids, what, start, end, eos), (case, ids)

    status, whole = post(server, "/v1/chat/completions", body)
    assert status == 200, whole
    for c in whole["choices"]:  # the same tokens as the oracle's
        tokens = [t["token"] for t in c["logprobs"]["content"]]
        assert logprob_tags(tokens) == tokens_as_tags(reference, ids[c["index"]])
    usage = whole["usage"]
    assert usage["completion_tokens"] == sum(map(len, ids))
    assert usage["completion_tokens_details"] == {"reasoning_tokens": sum(want)}

    events = stream(server, "/v1/chat/completions", {**body, "stream_options": USAGE})
    so_far = {0: 0, 1: 0}
    for ev in events[:-1]:
        (c,) = ev["choices"]
        if "role" in c["delta"]:
            assert ev["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
            continue
        k = c["index"]
        so_far[k] += len(c["logprobs"]["content"])
        prefix = ids[k][:so_far[k]]
        assert ev["usage"]["completion_tokens"] == len(prefix)
        assert ev["usage"]["completion_tokens_details"] == {
            "reasoning_tokens": counted(prefix, phase, start, end, eos)}, (case, k, prefix)
    assert so_far == {0: len(ids[0]), 1: len(ids[1])}
    assert events[-1]["choices"] == []
    assert events[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": sum(want)}
    final = stream(server, "/v1/chat/completions",
                   {**body, "stream_options": {"include_usage": True}})
    assert all("usage" not in ev for ev in final[:-1])
    assert final[-1]["usage"] == usage


def test_hidden_reasoning_is_still_counted(server, reference):  # noqa: F811
    """include_reasoning false drops the reasoning and its logprobs, not its count (vLLM counts
    before it suppresses them)."""
    phase, seed, bias_start, bias_end, bias_eos, _ = CASES["opened, ended early and late"]
    start, end, eos = ids_of(reference, "<think>", "</think>", "<|im_end|>")
    body = {"messages": USER, "n": 2, "max_tokens": 16, "temperature": 1.0, "seed": seed,
            "include_reasoning": False, "chat_template_kwargs": KWARGS[phase],
            "logit_bias": {str(start): bias_start, str(end): bias_end, str(eos): bias_eos}}
    _, want = expected(reference, body, phase)
    assert sum(want) > 0
    _, whole = post(server, "/v1/chat/completions", body)
    assert all(c["message"]["reasoning"] is None for c in whole["choices"])
    assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": sum(want)}
    events = stream(server, "/v1/chat/completions",
                    {**body, "stream_options": {"include_usage": True}})
    assert events[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": sum(want)}


def test_only_a_reasoning_parsers_chat_has_the_key(server, plain):  # noqa: F811
    """The same chat on the server with a reasoning parser has the key (0 where no reasoning
    came: the prompt closed it), on one without has none, even where the completion writes
    <think> ... </think>; vLLM's /v1/completions has none, a reasoning parser or not."""
    start, end = ids_of(server.llm, "<think>", "</think>")
    chat = {"messages": USER, "n": 2, "max_tokens": 8, "temperature": 1.0, "seed": 6,
            "logit_bias": {str(start): 2, str(end): 2.5}}
    closed = {**chat, "chat_template_kwargs": {"enable_thinking": False}}
    for body in (chat, closed):
        _, whole = post(server, "/v1/chat/completions", body)
        details = whole["usage"]["completion_tokens_details"]
        events = stream(server, "/v1/chat/completions", {**body, "stream_options": USAGE})
        assert all(ev["usage"]["completion_tokens_details"].keys() == {"reasoning_tokens"}
                   for ev in events)
        assert events[-1]["usage"]["completion_tokens_details"] == details
    assert details == {"reasoning_tokens": 0}
    opened = {**chat, "chat_template_kwargs": {"thinking": "open"}}
    for body in (chat, closed, opened):
        _, whole = post(plain, "/v1/chat/completions", body)
        assert "completion_tokens_details" not in whole["usage"]
        events = stream(plain, "/v1/chat/completions", {**body, "stream_options": USAGE})
        assert all("completion_tokens_details" not in ev["usage"] for ev in events)
    body = {"prompt": "<think>", "max_tokens": 4, "n": 2, "temperature": 1.0, "seed": 0}
    _, whole = post(server, "/v1/completions", body)
    assert whole["usage"]["completion_tokens"] == 8
    assert "completion_tokens_details" not in whole["usage"]
    events = stream(server, "/v1/completions", {**body, "stream_options": USAGE})
    assert all("completion_tokens_details" not in ev["usage"] for ev in events)
