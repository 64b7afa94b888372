"""Session 78's audit of the offline API's output objects and LLM.get_tokenizer() against current
vLLM (vllm-project/vllm): vllm/outputs.py (CompletionOutput, RequestOutput with add and
__repr__, PoolingRequestOutput, EmbeddingOutput, ClassificationOutput, ScoringOutput),
vllm/v1/engine/output_processor.py (RequestState._new_request_output /
_new_completion_output: what v1 sets), vllm/entrypoints/llm.py (LLM.__init__'s
disable_log_stats=True default, get_tokenizer) and vllm/renderers' get_tokenizer.

What differed, each test failing before its fix:
  - RequestOutput lacked lora_request, encoder_prompt, encoder_prompt_token_ids and
    kv_transfer_params; CompletionOutput lacked routed_experts, lora_request and
    kv_transfer_params. vLLM v1 sets RequestOutput.lora_request to the request's LoRARequest
    (None without one), leaves CompletionOutput.lora_request None, and the encoder fields None
    for a decoder-only model; kv_transfer_params is None without disaggregated prefill;
  - RequestOutput.metrics was {}: vLLM v1's is RequestStateStats only with log stats on, which
    its LLM turns off by default, so None (a dict is neither of its values);
  - a stream's deltas (LLM.stream) dropped those fields, and RequestOutput had no add(), the
    public merge of vLLM's deltas (aggregate=True) or replacement (False);
  - repr: vLLM's RequestOutput / CompletionOutput reprs (field order, the encoder fields,
    unquoted request_id and finish_reason); EmbeddingOutput / ClassificationOutput print their
    size, not every float; the pooling request outputs take num_cached_tokens before finished
    (vLLM's argument and repr order);
  - LLM.get_tokenizer() returned None where there is no tokenizer; vLLM raises ValueError
    "Tokenizer not available when `skip_tokenizer_init=True`". The server's two callers now read
    llm.engine.tokenizer, so a server on such an LLM still starts and answers /tokenize 400.

Oracles: vLLM's definitions as transcribed here (field sets, reprs), and the engine's own whole
output (LLM.generate, same seeds) for the merge of a stream's deltas."""

from __future__ import annotations

import dataclasses
import re

import pytest

from minivllm import (ClassificationOutput, ClassificationRequestOutput, CompletionOutput,
                      EmbeddingOutput, EmbeddingRequestOutput, Logprob, LoRARequest, RequestOutput,
                      SamplingParams, ScoringOutput, ScoringRequestOutput)
from minivllm.runtime.demo import VOCAB_SIZE, build_tokenizer
from minivllm.runtime.server import OpenAIServer

from engine_helpers import make_llm, serving
from hf_tiny import make_hf_model, save_checkpoint
from test_lora import MAX_RANK, write_adapter
from test_server import post

# vllm/outputs.py's fields (CompletionOutput's dataclass fields, RequestOutput.__init__'s
# parameters and kv_transfer_params).
VLLM_COMPLETION_FIELDS = {"index", "text", "token_ids", "cumulative_logprob", "logprobs",
                          "routed_experts", "finish_reason", "stop_reason", "lora_request",
                          "kv_transfer_params"}
VLLM_REQUEST_FIELDS = {"request_id", "prompt", "prompt_token_ids", "prompt_logprobs", "outputs",
                       "finished", "metrics", "lora_request", "encoder_prompt",
                       "encoder_prompt_token_ids", "num_cached_tokens", "kv_transfer_params"}
PROMPTS = [[5, 17, 42, 8, 99, 3], [61, 7, 7, 120, 33]]
SAMPLED = SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=8, logprobs=2,
                         ignore_eos=True)


def vllm_completion_repr(c) -> str:
    """vllm/outputs.py's CompletionOutput.__repr__."""
    return (f"CompletionOutput(index={c.index}, text={c.text!r}, token_ids={c.token_ids}, "
            f"routed_experts={c.routed_experts}, cumulative_logprob={c.cumulative_logprob}, "
            f"logprobs={c.logprobs}, finish_reason={c.finish_reason}, "
            f"stop_reason={c.stop_reason}, kv_transfer_params={c.kv_transfer_params})")


def vllm_request_repr(o) -> str:
    """vllm/outputs.py's RequestOutput.__repr__."""
    return (f"RequestOutput(request_id={o.request_id}, prompt={o.prompt!r}, "
            f"prompt_token_ids={o.prompt_token_ids}, encoder_prompt={o.encoder_prompt!r}, "
            f"encoder_prompt_token_ids={o.encoder_prompt_token_ids}, "
            f"prompt_logprobs={o.prompt_logprobs}, outputs={o.outputs}, "
            f"finished={o.finished}, metrics={o.metrics}, lora_request={o.lora_request}, "
            f"num_cached_tokens={o.num_cached_tokens}, "
            f"kv_transfer_params={o.kv_transfer_params})")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny checkpoint with the demo's byte-level BPE tokenizer (its vocabulary size)."""
    model = make_hf_model(seed=0, std=0.3, vocab_size=VOCAB_SIZE)
    path = save_checkpoint(model, tmp_path_factory.mktemp("s78_outputs") / "model")
    build_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def adapter(model_dir, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("s78_adapter") / "a")
    write_adapter(path, model_dir, r=4, alpha=8, targets="all-linear", seed=1)
    return LoRARequest("a", 1, path)


@pytest.fixture(scope="module")
def llm(model_dir, device):
    return make_llm(model_dir, device, enable_lora=True, max_loras=2, max_lora_rank=MAX_RANK,
                    max_model_len=64)


def token_prompts(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def check_vllm_values(out, lora) -> None:
    """What vLLM v1's output processor sets on a decoder-only model's output without log stats
    or KV transfer."""
    assert out.lora_request is lora
    assert out.metrics is None
    assert out.encoder_prompt is None and out.encoder_prompt_token_ids is None
    assert out.kv_transfer_params is None
    for c in out.outputs:
        # _new_completion_output passes no lora_request: the dataclass default
        assert c.lora_request is None and c.kv_transfer_params is None
        assert c.routed_experts is None


def test_the_classes_have_vllms_fields_and_methods():
    assert {f.name for f in dataclasses.fields(CompletionOutput)} == VLLM_COMPLETION_FIELDS
    # Every vLLM RequestOutput argument, by name; each read back as an attribute.
    lora = LoRARequest("x", 3, "/nowhere")
    c = CompletionOutput(index=0, text="ab", token_ids=[1, 2], cumulative_logprob=None,
                         logprobs=None, finish_reason="length", lora_request=lora)
    values = dict(request_id="r", prompt="p", prompt_token_ids=[9], prompt_logprobs=None,
                  outputs=[c], finished=True, metrics=None, lora_request=lora,
                  encoder_prompt=None, encoder_prompt_token_ids=None, num_cached_tokens=0,
                  kv_transfer_params=None)
    assert set(values) == VLLM_REQUEST_FIELDS
    out = RequestOutput(**values)
    assert {k: getattr(out, k) for k in values} == values
    assert c.finished() and c.lora_request is lora
    # Defaults as vLLM's constructor leaves them.
    bare = RequestOutput(request_id="r", prompt=None, prompt_token_ids=None, outputs=[],
                         finished=False)
    assert bare.metrics is None and bare.lora_request is None and bare.kv_transfer_params is None
    # The pooling outputs: vLLM's PoolingRequestOutput(request_id, outputs, prompt_token_ids,
    # num_cached_tokens, finished), positionally.
    for kind, inner in ((EmbeddingRequestOutput, EmbeddingOutput([0.5, 0.25])),
                        (ClassificationRequestOutput, ClassificationOutput([0.1, 0.9])),
                        (ScoringRequestOutput, ScoringOutput(0.75))):
        o = kind("p-1", inner, [4, 5], 3, False)
        assert (o.num_cached_tokens, o.finished) == (3, False)


def test_generate_outputs_carry_the_requests_lora_and_vllms_values(llm, adapter):
    """A LoRARequest per prompt ([adapter, None]) and one for every prompt; n=2."""
    outs = llm.generate(token_prompts(PROMPTS), SAMPLED, use_tqdm=False,
                        lora_request=[adapter, None])
    check_vllm_values(outs[0], adapter)
    check_vllm_values(outs[1], None)
    assert all(len(o.outputs) == 2 for o in outs)
    for o in llm.generate(token_prompts(PROMPTS), SAMPLED, use_tqdm=False,
                          lora_request=adapter):
        check_vllm_values(o, adapter)
    for o in llm.generate(token_prompts(PROMPTS), SAMPLED, use_tqdm=False):
        check_vllm_values(o, None)


def test_reprs_are_vllms(llm, adapter):
    out = llm.generate(token_prompts(PROMPTS[:1]), SAMPLED, use_tqdm=False,
                       lora_request=adapter)[0]
    assert repr(out.outputs[0]) == vllm_completion_repr(out.outputs[0])
    assert repr(out) == vllm_request_repr(out)
    assert f"lora_request={adapter}" in repr(out) and "metrics=None" in repr(out)
    assert "lora_request" not in repr(out.outputs[0])  # vLLM's leaves it out
    # vllm/outputs.py's pooling reprs: sizes, not the vectors.
    assert repr(EmbeddingOutput([0.5] * 7)) == "EmbeddingOutput(hidden_size=7)"
    assert repr(ClassificationOutput([0.2, 0.8])) == "ClassificationOutput(num_classes=2)"
    assert repr(ScoringOutput(0.5)) == "ScoringOutput(score=0.5)"
    o = ClassificationRequestOutput("c-1", ClassificationOutput([0.2, 0.8]), [1, 2], 0, True)
    assert repr(o) == ("ClassificationRequestOutput(request_id='c-1', "
                       "outputs=ClassificationOutput(num_classes=2), prompt_token_ids=[1, 2], "
                       "num_cached_tokens=0, finished=True)")


def test_an_engine_embeddings_repr_is_vllms(model_dir, device):
    pooling = make_llm(model_dir, device, runner="pooling", max_model_len=64)
    out = pooling.embed(token_prompts(PROMPTS[:1]), use_tqdm=False)[0]
    size = len(out.outputs.embedding)
    assert repr(out) == (f"EmbeddingRequestOutput(request_id={out.request_id!r}, "
                         f"outputs=EmbeddingOutput(hidden_size={size}), "
                         f"prompt_token_ids={PROMPTS[0]}, "
                         f"num_cached_tokens={out.num_cached_tokens}, finished=True)")


@pytest.mark.parametrize("lora", [True, False])
def test_stream_deltas_carry_the_fields_and_add_merges_them_into_generates_output(
        llm, adapter, lora):
    """Every delta of LLM.stream carries the request's lora_request and vLLM's values; vLLM's
    RequestOutput.add(delta, aggregate=True), as its RequestOutputCollector merges deltas,
    rebuilds what generate returns for the same seeded request."""
    lr = adapter if lora else None
    want = llm.generate(token_prompts(PROMPTS), SAMPLED, use_tqdm=False, lora_request=lr)
    merged: dict[str, RequestOutput] = {}
    order: list[str] = []
    for delta in llm.stream(token_prompts(PROMPTS), SAMPLED, lora_request=lr):
        check_vllm_values(delta, lr)
        if delta.request_id not in merged:
            merged[delta.request_id] = delta
            order.append(delta.request_id)
        else:
            merged[delta.request_id].add(delta, aggregate=True)
    for got, ref in zip((merged[i] for i in order), want):
        assert got.finished
        check_vllm_values(got, lr)
        pairs = zip(sorted(got.outputs, key=lambda c: c.index), ref.outputs)
        for g, r in pairs:
            assert (g.index, g.text, g.token_ids, g.finish_reason, g.stop_reason) == \
                (r.index, r.text, r.token_ids, r.finish_reason, r.stop_reason)
            assert g.logprobs == r.logprobs and g.cumulative_logprob == r.cumulative_logprob
        assert len(got.outputs) == len(ref.outputs) == 2


def test_add_without_aggregate_replaces_the_completion():
    """vLLM's add(aggregate=False): the later output's completion replaces the one of its index;
    a new index is appended; finished is or-ed."""
    def out(index, text, finished, reason=None):
        c = CompletionOutput(index=index, text=text, token_ids=[len(text)], finish_reason=reason)
        return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1], outputs=[c],
                             finished=finished)

    first = out(0, "ab", False)
    first.add(out(0, "abcd", True, "length"), aggregate=False)
    first.add(out(1, "x", False), aggregate=False)
    assert first.finished
    assert [(c.index, c.text, c.finish_reason) for c in first.outputs] == \
        [(0, "abcd", "length"), (1, "x", None)]
    # vLLM asserts where a delta's logprobs have nothing to extend; here a ValueError, raised
    # before anything is merged.
    later = out(0, "e", False)
    later.outputs[0].logprobs = [{5: Logprob(-0.5)}]
    with pytest.raises(ValueError, match="no logprobs"):
        first.add(later, aggregate=True)
    assert [c.text for c in first.outputs] == ["abcd", "x"] and first.finished


def test_get_tokenizer_without_one_raises_as_vllms_and_the_server_still_serves(model_dir,
                                                                              device, llm):
    assert llm.get_tokenizer() is llm.engine.tokenizer is not None
    bare = make_llm(model_dir, device, skip_tokenizer_init=True, max_model_len=64)
    assert bare.engine.tokenizer is None
    with pytest.raises(ValueError,
                       match=re.escape("Tokenizer not available when `skip_tokenizer_init=True`")):
        bare.get_tokenizer()
    # The server's callers read engine.tokenizer: it starts, refuses /tokenize, and generates.
    with serving(OpenAIServer(bare, port=0, model_name="bare")) as srv:
        status, err = post(srv, "/tokenize", {"prompt": "hi"})
        assert status == 400 and "no tokenizer" in err["error"]["message"], err
        status, got = post(srv, "/v1/completions", {"model": "bare", "prompt": PROMPTS[0],
                                                    "max_tokens": 3, "ignore_eos": True})
        assert status == 200 and got["choices"][0]["finish_reason"] == "length", got
