"""Scores of text pairs, as vLLM's LLM.score and its /score and /rerank routes compute them for a
pooling model: one query against many documents (1:N, the query repeated), or pairs of equal
lists (N:N).

A cross-encoder (a classifier head of one label: a Qwen3ForSequenceClassification, or the
original Qwen3-Reranker made one by hf_overrides) reads each pair as one prompt and scores its
last token: the head's logit through its activation (a sigmoid: for the reranker P(yes)). The
pair is joined as vLLM joins it for a model without a score template: tokenizer(text_1 +
text_2), the two strings concatenated and then tokenized (vLLM's default for an LM turned
reranker, use_sep_token false), or tokenizer(text_1, text_pair=text_2) (a classifier
checkpoint's default, use_sep_token true). An embedding model is a bi-encoder: each text is
embedded and a pair's score is the cosine of its two embeddings.

    plan = plan_scores("query", ["doc 1", "doc 2"], PoolingParams(), tokenizer=tok, head=cfg)
    ids = engine.add_pooling_requests(plan.prompts, plan.params)
    scores = plan.finish(outputs_of(ids))          # [ScoringRequestOutput], pair order
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..state.classifier import ClassifierConfig
from ..state.values import as_int
from .pooling import PoolingParams


@dataclass
class ScoringOutput:
    """One pair's score (vLLM's ScoringOutput)."""

    score: float


@dataclass
class ScoringRequestOutput:
    """What LLM.score returns per pair, as vLLM's: `outputs.score`, the ids the model read (a
    cross-encoder's pair prompt; for a bi-encoder the two texts' ids, a pad id between them when
    the tokenizer has one, as vLLM reports them), and the prompt tokens found in the prefix
    cache."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    # vLLM's order (PoolingRequestOutput's arguments and repr)
    num_cached_tokens: int = 0
    finished: bool = True


@dataclass
class ScorePlan:
    """The engine requests that score some pairs (`prompts`, one PoolingParams each), and
    `finish`, which makes their finished outputs (in request order) the pairs' scores."""

    prompts: list
    params: list[PoolingParams]
    finish: Callable[[list], list[ScoringRequestOutput]]


def score_texts(data, name: str, tokenizer) -> list[str]:
    """One side of LLM.score's input as texts: a text, {"prompt": text}, {"prompt_token_ids":
    ids} (decoded to its text, as vLLM's LLM.score took token prompts), or a list of them.
    TypeError / ValueError naming `name` and what is wrong."""
    items = [data] if isinstance(data, (str, dict)) else data
    if isinstance(items, (bytes, set, frozenset)) or not isinstance(items, (list, tuple)):
        raise TypeError(f"{name} must be a text, a prompt dict or a list of them, got "
                        f"{type(data).__name__}")
    texts = []
    for k, item in enumerate(items):
        if isinstance(item, dict):
            unknown = sorted(map(str, set(item) - {"prompt", "prompt_token_ids"}))
            if unknown or not item:
                raise ValueError(f"{name}[{k}]: a prompt dict holds 'prompt' or "
                                 f"'prompt_token_ids'" + (f", not {unknown}" if unknown else ""))
            if "prompt_token_ids" in item:
                item = tokenizer.decode(_token_ids(item["prompt_token_ids"], f"{name}[{k}]",
                                                   len(tokenizer)))
            else:
                item = item["prompt"]
        if not isinstance(item, str):
            raise TypeError(f"{name}[{k}] must be a text or a prompt dict, got "
                            f"{type(item).__name__}")
        texts.append(item)
    return texts


def _token_ids(ids, name: str, vocab: int) -> list[int]:
    """prompt_token_ids checked (ints in the tokenizer's vocabulary), as a list."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if isinstance(ids, (str, bytes, dict)) or not isinstance(ids, (list, tuple)) or not ids:
        raise ValueError(f"{name}: prompt_token_ids must be a non-empty list of token ids")
    out = []
    for t in ids:
        i = as_int(t)
        if i is None or not 0 <= i < vocab:
            raise ValueError(f"{name}: prompt_token_ids holds {t!r}, not a token id of the "
                             f"tokenizer's {vocab}")
        out.append(i)
    return out


def score_pairs(texts_1: list[str], texts_2: list[str]) -> list[tuple[str, str]]:
    """The pairs: 1:1, 1:N (the one text_1 with each text_2) or N:N (in order), as vLLM pairs
    them; ValueError in vLLM's words otherwise."""
    if len(texts_1) > 1 and len(texts_1) != len(texts_2):
        raise ValueError(f"Input lengths must be either 1:1, 1:N or N:N, got "
                         f"{len(texts_1)}:{len(texts_2)}")
    if not texts_1:
        raise ValueError("At least one text element must be given")
    if not texts_2:
        raise ValueError("At least one text_pair element must be given")
    if len(texts_1) == 1:
        texts_1 = texts_1 * len(texts_2)
    return list(zip(texts_1, texts_2))


def pair_prompt(tokenizer, text_1: str, text_2: str, use_sep_token: bool) -> dict:
    """A cross-encoder's prompt for one pair, as vLLM's get_score_prompt builds it for a model
    without a score template: {"prompt", "prompt_token_ids"}."""
    if use_sep_token:  # the tokenizer's own pair encoding (a separator, where it has one)
        ids = list(tokenizer(text=text_1, text_pair=text_2)["input_ids"])
        return {"prompt": tokenizer.decode(ids), "prompt_token_ids": ids}
    text = text_1 + text_2  # an LM turned reranker reads the two as one text
    return {"prompt": text, "prompt_token_ids": list(tokenizer(text=text)["input_ids"])}


def plan_scores(data_1, data_2, params: PoolingParams, *, tokenizer,
                head: ClassifierConfig | None) -> ScorePlan:
    """The requests that score data_1 against data_2 (score_texts' forms): a cross-encoder's
    pair prompts when `head` (a one-label classifier's config) is given, else (an embedding
    model) each text's embedding. ValueError / TypeError for bad inputs, before any request."""
    if tokenizer is None:
        raise ValueError("scoring needs a tokenizer (pairs are given as texts), and this LLM "
                         "has none")
    if not isinstance(params, PoolingParams):
        raise TypeError(f"pooling_params must be a PoolingParams or None, got "
                        f"{type(params).__name__}")
    texts_1 = score_texts(data_1, "data_1", tokenizer)
    texts_2 = score_texts(data_2, "data_2", tokenizer)
    pairs = score_pairs(texts_1, texts_2)
    if head is not None:
        if head.num_labels != 1:  # vLLM's words
            raise ValueError("Scoring API is only enabled for num_labels == 1.")
        scored = params.for_task("score")
        return ScorePlan(prompts=[pair_prompt(tokenizer, a, b, head.use_sep_token)
                                  for a, b in pairs],
                         params=[scored] * len(pairs), finish=_cross_encoder_scores)
    embed = params.for_task("embed")
    n = len(texts_1)
    pad = getattr(tokenizer, "pad_token_id", None)

    def finish(outs: list) -> list[ScoringRequestOutput]:
        firsts = outs[:n] * (len(outs) - n) if n == 1 else outs[:n]
        return [_bi_encoder_score(a, b, pad) for a, b in zip(firsts, outs[n:])]

    return ScorePlan(prompts=texts_1 + texts_2, params=[embed] * (n + len(texts_2)),
                     finish=finish)


def _cross_encoder_scores(outs: list) -> list[ScoringRequestOutput]:
    """A one-label classifier's outputs as scores (vLLM's ScoringOutput.from_base)."""
    return [ScoringRequestOutput(request_id=o.request_id, outputs=ScoringOutput(o.outputs.probs[0]),
                                 prompt_token_ids=o.prompt_token_ids, finished=o.finished,
                                 num_cached_tokens=o.num_cached_tokens) for o in outs]


def _bi_encoder_score(a, b, pad: int | None) -> ScoringRequestOutput:
    """Two embeddings' cosine in fp32 (vLLM's bi-encoder score)."""
    score = torch.nn.functional.cosine_similarity(torch.tensor(a.outputs.embedding).float(),
                                                  torch.tensor(b.outputs.embedding).float(), dim=0)
    return ScoringRequestOutput(request_id=f"{a.request_id}_{b.request_id}",
                                outputs=ScoringOutput(float(score)),
                                prompt_token_ids=a.prompt_token_ids + ([] if pad is None else [pad])
                                + b.prompt_token_ids,
                                num_cached_tokens=a.num_cached_tokens + b.num_cached_tokens)
