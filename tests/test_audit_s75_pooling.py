"""Session 75's audit of the pooling routes (/v1/embeddings, /score, /rerank, /classify): fields
vLLM's pooling requests take that were refused as unknown (priority; add_special_tokens of an
embedding or classification request), and a bad encoding_format that was taken. Each bad
request is a 400 naming its field before any work, and a good one after it embeds as before."""

from __future__ import annotations

import pytest
import torch
from tokenizers import processors

from minivllm.runtime.demo import build_tokenizer
from minivllm.runtime.openai_api import (RequestError, parse_classify, parse_embedding,
                                         parse_rerank, parse_score)
from minivllm.runtime.server import OpenAIServer

from engine_helpers import make_llm, serving
from hf_tiny import make_hf_model
from test_embed import hf_embedding, write_embedding_layout
from test_server import post


@pytest.fixture(scope="module")
def tok():
    """The demo tokenizer with an EOS appended to each text (as Qwen3-Embedding's appends its
    <|endoftext|>), so that add_special_tokens changes the prompt."""
    t = build_tokenizer()
    eos = t.eos_token
    t._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {eos}", special_tokens=[(eos, t.eos_token_id)])
    assert t.encode("Hello") == t.encode("Hello", add_special_tokens=False) + [t.eos_token_id]
    return t


@pytest.fixture(scope="module")
def hf_model(tok):
    return make_hf_model(seed=0, std=0.1, vocab_size=len(tok))


@pytest.fixture(scope="module")
def server(hf_model, tok, tmp_path_factory, device):
    path = write_embedding_layout(hf_model, tok, tmp_path_factory.mktemp("emb") / "model")
    llm = make_llm(path, device, runner="pooling", max_model_len=64)
    assert llm.get_tokenizer().encode("Hello")[-1] == tok.eos_token_id  # the saved one's
    with serving(OpenAIServer(llm, port=0, model_name="emb")) as srv:
        yield srv


GOOD = {"input": ["Hello", "The quick brown fox"]}


def embeddings(srv, body) -> list[list[float]]:
    status, got = post(srv, "/v1/embeddings", body)
    assert status == 200, got
    return [d["embedding"] for d in got["data"]]


def refused(srv, path, body, match) -> None:
    """A 400 naming `match`, no request left in the engine."""
    status, err = post(srv, path, body)
    assert status == 400 and match in err["error"]["message"], err
    assert err["error"]["type"] == "BadRequestError"
    assert not srv.llm.engine.requests


def test_an_empty_encoding_format_is_refused(server):
    """"" is neither "float" nor "base64": it was taken as "float" (`or "float"`)."""
    before = embeddings(server, GOOD)
    refused(server, "/v1/embeddings", {**GOOD, "encoding_format": ""}, "'encoding_format'")
    with pytest.raises(RequestError, match="'encoding_format' must be 'float' or 'base64'"):
        parse_embedding({"input": "x", "encoding_format": ""})
    assert parse_embedding({"input": "x", "encoding_format": None}).encoding_format == "float"
    assert embeddings(server, GOOD) == before


def test_priority_zero_is_taken_by_every_pooling_route(server):
    """vLLM's pooling requests carry priority (default 0; another value is an error without
    priority scheduling): a client sending the default was refused "unknown fields"."""
    before = embeddings(server, GOOD)
    assert embeddings(server, {**GOOD, "priority": 0}) == before
    for path, body in (("/score", {"text_1": "Hello", "text_2": ["a", "b"]}),
                       ("/rerank", {"query": "Hello", "documents": ["a", "b"]})):
        status, want = post(server, path, body)
        assert status == 200, want
        status, got = post(server, path, {**body, "priority": 0})
        assert status == 200, got
        key = "data" if path == "/score" else "results"
        assert got[key] == want[key]
        refused(server, path, {**body, "priority": 1}, "Priority scheduling is not enabled")
    refused(server, "/v1/embeddings", {**GOOD, "priority": -3},
            "Priority scheduling is not enabled")
    refused(server, "/v1/embeddings", {**GOOD, "priority": "high"}, "'priority' must be")
    for parse, body in ((parse_classify, {"input": "x"}), (parse_score, {"text_1": "a",
                                                                          "text_2": "b"}),
                        (parse_rerank, {"query": "a", "documents": ["b"]})):
        assert parse({**body, "priority": 0}).priority == 0
        assert parse({**body, "priority": 5}).priority == 5  # the server refuses it
    assert embeddings(server, GOOD) == before


def test_add_special_tokens_false_embeds_the_text_without_them(server, hf_model, tok):
    """vLLM's embedding and classification requests take add_special_tokens (default true):
    false tokenizes the text without the tokenizer's special tokens (here its appended EOS)."""
    before = embeddings(server, GOOD)
    assert embeddings(server, {**GOOD, "add_special_tokens": True}) == before
    status, got = post(server, "/v1/embeddings", {**GOOD, "add_special_tokens": False})
    assert status == 200, got
    for text, d in zip(GOOD["input"], got["data"]):
        ids = tok.encode(text, add_special_tokens=False)
        torch.testing.assert_close(torch.tensor(d["embedding"]), hf_embedding(hf_model, ids),
                                   atol=1e-5, rtol=1e-4)
    with_eos = sum(len(tok.encode(t)) for t in GOOD["input"])
    assert got["usage"]["prompt_tokens"] == with_eos - len(GOOD["input"])
    # Token ids are taken as given either way.
    ids = tok.encode("Hello")
    assert embeddings(server, {"input": ids, "add_special_tokens": False}) == \
        embeddings(server, {"input": ids})
    refused(server, "/v1/embeddings", {**GOOD, "add_special_tokens": "no"},
            "'add_special_tokens' must be true or false")
    # A text that is nothing but special tokens is empty without them.
    refused(server, "/v1/embeddings", {"input": ["Hello", ""], "add_special_tokens": False},
            "empty")
    assert parse_classify({"input": "x", "add_special_tokens": False}).add_special_tokens is False
    assert embeddings(server, GOOD) == before


# -- /v1/completions' add_special_tokens (vLLM's: true by default) -----------------------------

@pytest.fixture(scope="module")
def generating_server(hf_model, tok, tmp_path_factory, device):
    from hf_tiny import save_checkpoint

    path = save_checkpoint(hf_model, tmp_path_factory.mktemp("gen") / "model")
    tok.save_pretrained(path)
    llm = make_llm(path, device, max_model_len=64)
    with serving(OpenAIServer(llm, port=0, model_name="gen")) as srv:
        yield srv


def test_a_completion_without_special_tokens_is_the_texts_ids_alone(generating_server, tok):
    """add_special_tokens false was refused as an unknown field; now the text's ids without
    the appended EOS are the prompt: the same greedy tokens as a request giving those ids."""
    srv = generating_server
    base = {"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0.0,
            "ignore_eos": True}
    bare = tok.encode(base["prompt"], add_special_tokens=False)

    def complete(body):
        status, got = post(srv, "/v1/completions", body)
        assert status == 200, got
        return got["usage"]["prompt_tokens"], got["choices"][0]["text"]

    with_eos = complete(base)
    assert with_eos[0] == len(bare) + 1
    assert complete({**base, "add_special_tokens": True}) == with_eos
    without = complete({**base, "add_special_tokens": False})
    assert without == complete({**base, "prompt": bare})
    assert without[0] == len(bare) and without[1] != with_eos[1]  # the EOS changed the answer
    refused(srv, "/v1/completions", {**base, "add_special_tokens": "no"}, "'add_special_tokens'")
    assert complete(base) == with_eos
