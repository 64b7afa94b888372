"""Classification and reranking (LLM.classify, LLM.score, the server's /score, /rerank and
/classify: vLLM's pooling runner) against transformers: the original Qwen3-Reranker layout (a
Qwen3ForCausalLM checkpoint with vLLM's hf_overrides) scores P(yes) = softmax(logit_no,
logit_yes)[yes] of Qwen3ForCausalLM's logits at the pair's last token; a
Qwen3ForSequenceClassification checkpoint classifies as transformers' model of that class; an
embedding model scores the cosine of two embeddings. Through the engine's batched, chunked,
prefix-cached prefill; bad inputs are errors that name them before any step runs."""

from __future__ import annotations

import copy
import os
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedTokenizerFast, Qwen3ForSequenceClassification

from minivllm import (ClassificationRequestOutput, CheckpointError, PoolingParams,
                      ScoringRequestOutput)
from minivllm.runtime.demo import _TEXT, SPECIAL_TOKENS

from engine_helpers import make_llm
from hf_tiny import make_hf_model, save_checkpoint

TOL = dict(rtol=1e-5, atol=1e-5)  # fp32 on both sides
RERANKER = {"architectures": ["Qwen3ForSequenceClassification"],
            "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}
# Qwen3-Reranker's prompt (its model card), as vLLM's example formats it: the query's part and
# the document's, joined by LLM.score.
PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the "
          "Query and the Instruct provided. Note that the answer can only be \"yes\" or \"no\"."
          "<|im_end|>\n<|im_start|>user\n")
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QUERY = PREFIX + "<Instruct>: Given a web search query, retrieve relevant passages\n<Query>: fox\n"
DOCS = ["<Document>: The quick brown fox jumps over the lazy dog." + SUFFIX,
        "<Document>: Hello" + SUFFIX,
        "<Document>: " + " ".join(["It was the best of times, it was the worst of times."] * 4)
        + SUFFIX]


def rerank_tokenizer() -> PreTrainedTokenizerFast:
    """The demo's byte-level BPE, trained with lines of "yes" and "no" so that both are tokens
    of its vocabulary, as they are of Qwen3's (the reranker's classifier_from_token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([_TEXT + "yes\nno\n" * 20], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")


@pytest.fixture(scope="module")
def tok():
    t = rerank_tokenizer()
    assert None not in (t.convert_tokens_to_ids("yes"), t.convert_tokens_to_ids("no"))
    return t


@pytest.fixture(scope="module")
def hf_model(tok):
    return make_hf_model(seed=0, std=0.1, vocab_size=len(tok))


@pytest.fixture(scope="module")
def causal_dir(hf_model, tok, tmp_path_factory):
    """The original Qwen3-Reranker's layout: a Qwen3ForCausalLM checkpoint (untied lm_head)."""
    path = save_checkpoint(hf_model, tmp_path_factory.mktemp("reranker") / "model")
    tok.save_pretrained(path)
    return path


def seq_cls_model(backbone, num_labels: int, seed: int = 1, **config) -> torch.nn.Module:
    """transformers' Qwen3ForSequenceClassification on `backbone`'s weights, its score head
    drawn; pad_token_id None, so that it scores the last token of a batch of one."""
    cfg = copy.deepcopy(backbone.config)
    cfg.num_labels = num_labels
    for key, value in config.items():
        setattr(cfg, key, value)
    model = Qwen3ForSequenceClassification(cfg).float().eval()
    model.model.load_state_dict(backbone.model.state_dict())
    torch.manual_seed(seed)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.3)
    assert model.config.pad_token_id is None
    return model


@pytest.fixture(scope="module")
def classifier(hf_model, tok, tmp_path_factory):
    """(transformers' model, its checkpoint): three labels with names."""
    model = seq_cls_model(hf_model, 3, id2label={0: "neg", 1: "neutral", 2: "pos"},
                          label2id={"neg": 0, "neutral": 1, "pos": 2})
    path = str(tmp_path_factory.mktemp("cls3") / "model")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def cross_encoder(hf_model, tok, tmp_path_factory):
    """(transformers' model, its checkpoint): one label, a converted reranker's shape."""
    model = seq_cls_model(hf_model, 1, seed=2)
    path = str(tmp_path_factory.mktemp("cls1") / "model")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model, path


def hf_p_yes(model, tok, ids) -> float:
    """The reranker's score, as Qwen3-Reranker's model card computes it: the last token's
    logits of "no" and "yes", softmaxed, P(yes)."""
    no, yes = tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes")
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    return float(torch.softmax(logits[[no, yes]], dim=-1)[1])


def hf_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def reranker(path, device, **kw):
    return make_llm(path, device, runner="pooling", hf_overrides=RERANKER, **kw)


# -- the original Qwen3-Reranker ------------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_reranker_scores_are_transformers_p_yes(async_scheduling, causal_dir, hf_model, tok,
                                                device):
    """One query against documents of many lengths, the longest prefilled in chunks beside the
    others (max_num_batched_tokens 32), the query's blocks shared through the prefix cache: each
    score is transformers' P(yes) at the pair's last token, its prompt the query and document
    concatenated, then tokenized (vLLM's join for an LM turned reranker)."""
    llm = reranker(causal_dir, device, max_num_batched_tokens=32,
                   async_scheduling=async_scheduling)
    assert llm.config.runner == "pooling" and llm.config.classifier.num_labels == 1
    outs = llm.score(QUERY, DOCS, use_tqdm=False)
    assert len(outs) == len(DOCS) and len({o.request_id for o in outs}) == len(outs)
    lengths = []
    for doc, out in zip(DOCS, outs):
        ids = tok(QUERY + doc)["input_ids"]
        assert isinstance(out, ScoringRequestOutput) and out.finished
        assert out.prompt_token_ids == ids
        assert abs(out.outputs.score - hf_p_yes(hf_model, tok, ids)) < 1e-5
        lengths.append(len(ids))
    s = llm.stats
    assert max(lengths) > 32 and s.max_step_tokens == 32 and s.max_step_seqs > 1
    assert s.prompt_tokens_cached > 0 and s.generation_tokens == 0
    assert not llm.engine.requests and llm.engine.block_manager.num_free == llm.engine.num_blocks
    # N:N: the lists pair in order; a pair is scored as it is alone.
    pairs = llm.score([QUERY, "Hello"], [DOCS[1], ", my name is Ada"], use_tqdm=False)
    assert abs(pairs[0].outputs.score - outs[1].outputs.score) < 1e-6
    ids = tok("Hello, my name is Ada")["input_ids"]
    assert pairs[1].prompt_token_ids == ids
    assert abs(pairs[1].outputs.score - hf_p_yes(hf_model, tok, ids)) < 1e-5


def test_the_pair_is_one_text_then_tokenized(causal_dir, hf_model, tok, device):
    """vLLM joins an LM reranker's pair as text_1 + text_2 before tokenizing: where a token
    spans the join the ids differ from the two texts' ids concatenated, and the score is
    transformers' on the joined text's ids."""
    a, b = "Hello, my na", "me is Ada"
    assert tok(a + b)["input_ids"] != tok(a)["input_ids"] + tok(b)["input_ids"]
    (out,) = reranker(causal_dir, device).score(a, b, use_tqdm=False)
    assert out.prompt_token_ids == tok(a + b)["input_ids"]
    assert abs(out.outputs.score - hf_p_yes(hf_model, tok, tok(a + b)["input_ids"])) < 1e-5


def test_a_tied_reranker_takes_the_embedding_rows(tok, tmp_path, device):
    """A checkpoint with tied embeddings (Qwen3-Reranker-0.6B's) has no lm_head.weight: the
    head is cut from the embedding's rows of "no" and "yes", as vLLM does."""
    model = make_hf_model(seed=3, std=0.1, vocab_size=len(tok), tie_word_embeddings=True)
    path = save_checkpoint(model, tmp_path / "tied")
    tok.save_pretrained(path)
    assert "lm_head.weight" not in load_file(os.path.join(path, "model.safetensors"))
    outs = reranker(path, device).score(QUERY, DOCS[:2], use_tqdm=False)
    for doc, out in zip(DOCS, outs):
        assert abs(out.outputs.score - hf_p_yes(model, tok, tok(QUERY + doc)["input_ids"])) < 1e-5


def test_the_reranker_head_is_the_difference_of_two_rows(causal_dir, hf_model, tok, device):
    """The loaded head is one label, lm_head[yes] - lm_head[no] in fp32; classify returns its
    sigmoid (P(yes)), or with use_activation=False its logit, logit_yes - logit_no."""
    llm = reranker(causal_dir, device)
    no, yes = tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes")
    head = hf_model.lm_head.weight.detach()
    torch.testing.assert_close(llm.engine.classifier.weight, (head[yes] - head[no])[None],
                               rtol=0, atol=0)
    ids = tok(QUERY + DOCS[0])["input_ids"]
    (prob,), (logit,) = (o.outputs.probs for o in llm.classify(
        [{"prompt_token_ids": ids}] * 2, [PoolingParams(), PoolingParams(use_activation=False)],
        use_tqdm=False))
    with torch.no_grad():
        last = hf_model(torch.tensor([ids])).logits[0, -1]
    assert abs(logit - float(last[yes] - last[no])) < 1e-4
    assert abs(prob - hf_p_yes(hf_model, tok, ids)) < 1e-5
    (scored,) = llm.score(QUERY, DOCS[0], pooling_params=PoolingParams(use_activation=False),
                          use_tqdm=False)
    assert abs(scored.outputs.score - logit) < 1e-6


def test_no_post_processing_keeps_the_tokens_rows(causal_dir, hf_model, tok, device):
    """vLLM's other method, "no_post_processing": a label per token, its LM-head row; classify
    is the softmax over those tokens' logits (for ["no", "yes"]: [1 - P(yes), P(yes)]), and
    two labels cannot score."""
    llm = make_llm(causal_dir, device, runner="pooling", hf_overrides={
        "architectures": ["Qwen3ForSequenceClassification"],
        "classifier_from_token": ["no", "yes"], "method": "no_post_processing"})
    assert llm.config.classifier.num_labels == 2
    ids = tok(QUERY + DOCS[1])["input_ids"]
    (out,) = llm.classify([{"prompt_token_ids": ids}], use_tqdm=False)
    p = hf_p_yes(hf_model, tok, ids)
    assert out.outputs.probs == pytest.approx([1 - p, p], abs=1e-5)
    with pytest.raises(ValueError, match="only enabled for num_labels == 1"):
        llm.score(QUERY, DOCS[1])


def test_token_prompts_are_decoded_as_vllm_took_them(causal_dir, tok, device):
    """{"prompt_token_ids": ids} is read as its text (vLLM's LLM.score decoded token prompts),
    {"prompt": text} as the text; truncate_prompt_tokens keeps each pair's last k tokens."""
    llm = reranker(causal_dir, device)
    want = llm.score(QUERY, DOCS[:2], use_tqdm=False)
    got = llm.score({"prompt_token_ids": tok(QUERY)["input_ids"]},
                    [{"prompt": DOCS[0]}, {"prompt_token_ids": tok(DOCS[1])["input_ids"]}],
                    use_tqdm=False)
    assert [o.outputs.score for o in got] == pytest.approx([o.outputs.score for o in want],
                                                           abs=1e-6)
    (cut,) = llm.score(QUERY, DOCS[0], truncate_prompt_tokens=7, use_tqdm=False)
    assert cut.prompt_token_ids == want[0].prompt_token_ids[-7:]


# -- Qwen3ForSequenceClassification checkpoints --------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_classify_is_transformers_sequence_classification(async_scheduling, classifier, tok,
                                                          device):
    """A three-label checkpoint (runner "auto" finds it a pooling model): each prompt's probs are
    the softmax of transformers' logits at its last token, through chunked, batched prefill;
    use_activation=False gives the logits; requests of both kinds share steps."""
    model, path = classifier
    llm = make_llm(path, device, max_num_batched_tokens=16, async_scheduling=async_scheduling)
    assert llm.config.runner == "pooling" and llm.config.classifier.labels == ("neg", "neutral",
                                                                               "pos")
    prompts = [tok(QUERY + d)["input_ids"] for d in DOCS] + [[5], tok("Hello")["input_ids"]]
    params = [PoolingParams(use_activation=k % 2 == 1) for k in range(len(prompts))]
    outs = llm.classify([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, pp, out in zip(prompts, params, outs):
        assert isinstance(out, ClassificationRequestOutput) and out.prompt_token_ids == p
        assert out.outputs.num_classes == 3
        logits = hf_logits(model, p)
        want = logits if not pp.use_activation else torch.softmax(logits, -1)
        torch.testing.assert_close(torch.tensor(out.outputs.probs), want, **TOL)
    assert llm.stats.max_step_tokens == 16 and llm.stats.max_step_seqs > 1
    # Text prompts, tokenized as embed's are; a single prompt; truncate_prompt_tokens.
    (text,) = llm.classify("Hello", use_tqdm=False)
    assert text.prompt_token_ids == prompts[-1]
    torch.testing.assert_close(torch.tensor(text.outputs.probs),
                               torch.softmax(hf_logits(model, prompts[-1]), -1), **TOL)
    (cut,) = llm.classify([{"prompt_token_ids": prompts[0]}], truncate_prompt_tokens=5,
                          use_tqdm=False)
    torch.testing.assert_close(torch.tensor(cut.outputs.probs),
                               torch.softmax(hf_logits(model, prompts[0][-5:]), -1), **TOL)


def test_problem_type_sets_the_activation(hf_model, tok, tmp_path, device):
    """As vLLM (transformers' loss for it): regression returns the logits, multi-label a
    sigmoid per label."""
    for kind, act in (("regression", lambda x: x), ("multi_label_classification", torch.sigmoid)):
        model = seq_cls_model(hf_model, 2, problem_type=kind)
        path = str(tmp_path / kind)
        model.save_pretrained(path)
        tok.save_pretrained(path)
        ids = tok(DOCS[0])["input_ids"]
        (out,) = make_llm(path, device).classify([{"prompt_token_ids": ids}], use_tqdm=False)
        torch.testing.assert_close(torch.tensor(out.outputs.probs), act(hf_logits(model, ids)),
                                   **TOL)


def test_a_one_label_classifier_is_a_cross_encoder(cross_encoder, tok, device):
    """One label: classify's probs are the sigmoid of the logit (vLLM's activation for
    num_labels == 1), and score joins a pair with the tokenizer's pair encoding (vLLM's default
    for a classifier checkpoint, use_sep_token): transformers' sigmoid on those ids."""
    model, path = cross_encoder
    llm = make_llm(path, device)
    assert llm.config.classifier.use_sep_token
    (c,) = llm.classify([QUERY], use_tqdm=False)
    ids = tok(QUERY)["input_ids"]
    assert c.outputs.num_classes == 1
    assert abs(c.outputs.probs[0] - float(torch.sigmoid(hf_logits(model, ids))[0])) < 1e-5
    outs = llm.score(QUERY, DOCS, use_tqdm=False)
    for doc, out in zip(DOCS, outs):
        pair = tok(text=QUERY, text_pair=doc)["input_ids"]
        assert out.prompt_token_ids == pair
        assert abs(out.outputs.score - float(torch.sigmoid(hf_logits(model, pair))[0])) < 1e-5


# -- an embedding model scores as a bi-encoder -------------------------------------------------


def test_an_embedding_model_scores_the_cosine(hf_model, causal_dir, tok, device):
    """LLM.score on an embedding model (vLLM's bi-encoder): the cosine of transformers'
    last-token hidden states of the two texts; the query is embedded once."""
    llm = make_llm(causal_dir, device, runner="pooling")  # no hf_overrides: it embeds
    outs = llm.score("Hello", ["The quick brown fox", "Hello"], use_tqdm=False)
    with torch.no_grad():
        h = [hf_model.model(torch.tensor([tok(t)["input_ids"]])).last_hidden_state[0, -1]
             for t in ("Hello", "The quick brown fox")]
    want = float(torch.nn.functional.cosine_similarity(h[0], h[1], dim=0))
    assert abs(outs[0].outputs.score - want) < 1e-5
    assert abs(outs[1].outputs.score - 1.0) < 1e-5
    hello = tok("Hello")["input_ids"]
    assert outs[1].prompt_token_ids == hello + [tok.pad_token_id] + hello
    assert llm.stats.prompt_tokens_computed + llm.stats.prompt_tokens_cached == \
        len(hello) * 2 + len(tok("The quick brown fox")["input_ids"])
    # The server's /score and /rerank serve an embedding model too (vLLM's routes for it).
    from test_server import post

    srv = serve(llm)
    try:
        status, got = post(srv, "/score", {"text_1": "Hello", "text_2": ["The quick brown fox",
                                                                         "Hello"]})
        assert status == 200
        assert [d["score"] for d in got["data"]] == pytest.approx([want, 1.0], abs=1e-5)
        status, got = post(srv, "/rerank", {"query": "Hello", "documents": ["The quick brown fox",
                                                                            "Hello"]})
        assert [r["index"] for r in got["results"]] == [1, 0]
        assert post(srv, "/classify", {"input": "Hello"})[0] == 404
    finally:
        srv.shutdown()


# -- what each LLM refuses ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared(causal_dir, classifier, device):
    """(the reranker, the three-label classifier, a generating LLM, an embedding LLM)."""
    return (reranker(causal_dir, device), make_llm(classifier[1], device),
            make_llm(causal_dir, device, runner="generate"),
            make_llm(causal_dir, device, runner="pooling"))


@pytest.mark.parametrize("which, call, exc, error", [
    (2, lambda llm: llm.score("a", "b"), ValueError,
     r"LLM.score\(\) is only supported for pooling models"),
    (2, lambda llm: llm.classify(["a"]), ValueError,
     r"LLM.classify\(\) is only supported for pooling models"),
    (3, lambda llm: llm.classify(["a"]), ValueError, "Classification API is not supported"),
    (0, lambda llm: llm.embed(["a"]), ValueError, "Embedding API is not supported"),
    (1, lambda llm: llm.score("a", "b"), ValueError,
     "Scoring API is only enabled for num_labels == 1"),
    (0, lambda llm: llm.score(["a", "b"], ["c", "d", "e"]), ValueError,
     "Input lengths must be either 1:1, 1:N or N:N"),
    (0, lambda llm: llm.score([], ["c"]), ValueError, "At least one text element"),
    (0, lambda llm: llm.score("a", []), ValueError, "At least one text_pair element"),
    (0, lambda llm: llm.score("a", ["b", 3]), TypeError, r"data_2\[1\] must be a text"),
    (0, lambda llm: llm.score(b"a", "b"), TypeError, "data_1 must be a text"),
    (0, lambda llm: llm.score("a", {"text": "b"}), ValueError, "not \\['text'\\]"),
    (0, lambda llm: llm.score("a", {"prompt_token_ids": [1, 10**6]}), ValueError,
     "not a token id"),
    (0, lambda llm: llm.score("a", "b", pooling_params=PoolingParams(dimensions=8)),
     ValueError, "task 'score' only supports use_activation"),
    (0, lambda llm: llm.score("a", "b", pooling_params={"use_activation": False}), TypeError,
     "pooling_params must be a PoolingParams"),
    (1, lambda llm: llm.classify(["a"], PoolingParams(normalize=False)), ValueError,
     "task 'classify' only supports use_activation"),
    (1, lambda llm: llm.classify(["a"], PoolingParams(task="embed")), ValueError,
     "cannot overwrite task='embed' with 'classify'"),
    (1, lambda llm: llm.classify(["a", ""]), ValueError, "the prompt is empty"),
    (3, lambda llm: llm.engine.add_pooling_requests(["a"], [PoolingParams(task="classify")]),
     ValueError, "a classify request needs a classifier head"),
])
def test_bad_calls_are_named_before_any_step(shared, which, call, exc, error):
    llm = shared[which]
    steps = llm.stats.steps
    with pytest.raises(exc, match=error):
        call(llm)
    assert llm.stats.steps == steps and not llm.engine.requests


@pytest.mark.parametrize("overrides, error", [
    ({**RERANKER, "classifier_from_token": ["yes"]}, "needs classifier_from_token, the two"),
    ({**RERANKER, "classifier_from_token": None}, "needs classifier_from_token"),
    ({**RERANKER, "classifier_from_token": ["no", "maybe"]},
     "'maybe' is not a token of the tokenizer's vocabulary"),
    ({**RERANKER, "is_original_qwen3_reranker": False}, "classifier_from_token and method go"),
    ({**RERANKER, "is_original_qwen3_reranker": "yes"}, "must be true or false"),
    ({**RERANKER, "is_original_qwen3_reranker": False, "method": "from_3_way"},
     "method must be one of"),
    ({"architectures": ["Qwen3ForSequenceClassification"]},
     "missing tensor score.weight"),
    ({**RERANKER, "sbert_ce_default_activation_function": "torch.nn.modules.activation.Tanh"},
     "cross-encoder activation"),
])
def test_bad_classifier_configs(causal_dir, device, overrides, error):
    with pytest.raises(ValueError, match=error):
        make_llm(causal_dir, device, runner="pooling", hf_overrides=overrides)


def test_runners_of_a_classifier(causal_dir, classifier, device):
    """runner "auto" is pooling for a Qwen3ForSequenceClassification, as config.json or
    hf_overrides name it; it cannot generate; task="score" (vLLM's older form) is pooling."""
    assert reranker(causal_dir, device).config.runner == "pooling"
    assert make_llm(causal_dir, device, hf_overrides=RERANKER).config.runner == "pooling"
    assert make_llm(causal_dir, device, task="score",
                    hf_overrides=RERANKER).config.classifier is not None
    with pytest.raises(ValueError, match="names Qwen3ForSequenceClassification, which classifies"):
        make_llm(classifier[1], device, runner="generate")
    with pytest.raises(ValueError, match="needs the tokenizer"):
        reranker(causal_dir, device, skip_tokenizer_init=True)


def test_a_mis_shaped_score_weight_is_named(classifier, tmp_path, device):
    _, path = classifier
    bad = tmp_path / "bad"
    os.makedirs(bad)
    for f in os.listdir(path):
        if not f.endswith(".safetensors"):
            with open(os.path.join(path, f), "rb") as src, open(bad / f, "wb") as dst:
                dst.write(src.read())
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors["score.weight"] = tensors["score.weight"][:2]
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(CheckpointError,
                       match=r"score.weight has shape \(2, 64\), expected \(3, 64\)"):
        make_llm(str(bad), device)


# -- the server's /score, /rerank and /classify -------------------------------------------------


def serve(llm):
    from minivllm.runtime.server import OpenAIServer

    srv = OpenAIServer(llm, port=0, model_name="rr")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def test_the_server_scores_and_reranks_as_vllm(causal_dir, hf_model, tok, device):
    """vLLM's /score (each of its request forms, /v1/score too) and /rerank (/v1/rerank,
    /v2/rerank: documents by relevance, top_n), over a reranker: transformers' P(yes) for each
    pair, usage counting the pairs' prompt tokens; bad requests 400 with the error named, and
    the routes of other models 404."""
    from test_server import post

    srv = serve(reranker(causal_dir, device, max_model_len=512))
    try:
        want = [hf_p_yes(hf_model, tok, tok(QUERY + d)["input_ids"]) for d in DOCS]
        tokens = sum(len(tok(QUERY + d)["input_ids"]) for d in DOCS)
        for path, body in (("/score", {"queries": QUERY, "documents": DOCS}),
                           ("/v1/score", {"text_1": QUERY, "text_2": DOCS, "model": "rr"}),
                           ("/score", {"data_1": [QUERY] * 3, "data_2": DOCS}),
                           ("/score", {"queries": QUERY, "items": DOCS})):
            status, got = post(srv, path, body)
            assert status == 200 and got["object"] == "list" and got["model"] == "rr", got
            assert [d["index"] for d in got["data"]] == [0, 1, 2]
            assert all(d["object"] == "score" for d in got["data"])
            assert [d["score"] for d in got["data"]] == pytest.approx(want, abs=1e-5)
            assert got["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
        order = sorted(range(3), key=lambda k: -want[k])
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            status, got = post(srv, path, {"query": QUERY, "documents": DOCS, "top_n": 2})
            assert status == 200 and got["model"] == "rr", got
            assert [r["index"] for r in got["results"]] == order[:2]
            for r in got["results"]:
                assert r["document"]["text"] == DOCS[r["index"]]
                assert abs(r["relevance_score"] - want[r["index"]]) < 1e-5
            assert got["usage"]["prompt_tokens"] == tokens
        _, every = post(srv, "/rerank", {"query": QUERY, "documents": DOCS})
        assert [r["index"] for r in every["results"]] == order
        _, raw = post(srv, "/rerank", {"query": QUERY, "documents": DOCS[0],
                                       "use_activation": False})
        logit = float(torch.logit(torch.tensor(want[0])))  # the sigmoid's inverse
        assert abs(raw["results"][0]["relevance_score"] - logit) < 1e-4
        # The reranker is a one-label classifier: /classify serves it too.
        status, cls = post(srv, "/classify", {"input": [QUERY + DOCS[0]]})
        assert status == 200 and cls["data"][0]["num_classes"] == 1
        assert cls["data"][0]["label"] == "LABEL_0"
        assert abs(cls["data"][0]["probs"][0] - want[0]) < 1e-5
        for path, bad, match in (
                ("/score", {"queries": ["a", "b"], "documents": ["c", "d", "e"]},
                 "Input lengths must be either 1:1, 1:N or N:N"),
                ("/score", {"queries": "a"}, "give one pair of fields"),
                ("/score", {"queries": "a", "documents": "b", "text_1": "c"},
                 "give one pair of fields"),
                ("/score", {"queries": "a", "documents": [{"type": "image_url"}]},
                 "minivllm scores texts"),
                ("/score", {"queries": "a", "documents": []}, "At least one text_pair"),
                ("/rerank", {"documents": ["a"]}, "'query' is required"),
                ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "'top_n' must be"),
                ("/rerank", {"query": "a", "documents": ["b"], "top_k": 1}, "unknown fields"),
                ("/rerank", {"query": "a", "documents": ["b"], "truncate_prompt_tokens": 0},
                 "truncate_prompt_tokens"),
                ("/classify", {"input": []}, "'input' must be")):
            status, err = post(srv, path, bad)
            assert status == 400 and match in err["error"]["message"], (path, err)
        status, err = post(srv, "/score", {"model": "other", "queries": "a", "documents": "b"})
        assert status == 404
        for path in ("/v1/embeddings", "/v1/completions"):
            status, err = post(srv, path, {"input": "a", "prompt": "a"})
            assert status == 404 and "no route" in err["error"]["message"]
        assert not srv.llm.engine.requests
    finally:
        srv.shutdown()


def test_the_server_classifies_and_routes_by_model(classifier, causal_dir, tok, device):
    """/classify over a three-label classifier: transformers' softmax and its likeliest
    label's name; such a model has no score (404), nor has a generating LLM."""
    from test_server import post

    model, path = classifier
    srv = serve(make_llm(path, device))
    try:
        prompts = ["Hello", "The quick brown fox"]
        status, got = post(srv, "/classify", {"input": prompts})
        assert status == 200 and got["object"] == "list"
        for d, text in zip(got["data"], prompts):
            probs = torch.softmax(hf_logits(model, tok(text)["input_ids"]), -1)
            torch.testing.assert_close(torch.tensor(d["probs"]), probs, **TOL)
            assert d["label"] == ("neg", "neutral", "pos")[int(probs.argmax())]
            assert d["num_classes"] == 3
        status, err = post(srv, "/score", {"queries": "a", "documents": "b"})
        assert status == 404
    finally:
        srv.shutdown()
    srv = serve(make_llm(causal_dir, device, runner="generate"))
    try:
        for route in ("/score", "/rerank", "/classify"):
            assert post(srv, route, {"query": "a", "documents": ["b"]})[0] == 404
    finally:
        srv.shutdown()
