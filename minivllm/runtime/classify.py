"""Classification, as vLLM's pooling runner serves it: `LLM(model, runner="pooling").classify(...)`
for a Qwen3ForSequenceClassification checkpoint, or a Qwen3ForCausalLM one that hf_overrides
make a classifier (the original Qwen3-Reranker: state/classifier.py). The outputs of
LLM.classify, and the head's loading, which needs the tokenizer for classifier_from_token.

A classification request is an embedding request's sequence (runtime/pooling.py): its prompt
is prefilled as any other and the step that computes its last token returns that token's
final-normed hidden state; the engine applies the head to it (functional/classify.py):
probabilities, or one score for a one-label head.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..state.classifier import ClassifierConfig, ClassifierHead, load_classifier_head


@dataclass
class ClassificationOutput:
    """One prompt's class probabilities (vLLM's ClassificationOutput): the head's activation of
    its logits (softmax over the labels; one label: a sigmoid), or the logits themselves with
    PoolingParams(use_activation=False)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)

    def __repr__(self) -> str:  # vLLM's: the count, not every probability
        return f"ClassificationOutput(num_classes={self.num_classes})"


@dataclass
class ClassificationRequestOutput:
    """What LLM.classify returns per prompt, as vLLM's: `outputs.probs`, the prompt's ids (after
    truncate_prompt_tokens), and the prompt tokens found in the prefix cache."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    # vLLM's order (PoolingRequestOutput's arguments and repr)
    num_cached_tokens: int = 0
    finished: bool = True


def classifier_token_ids(tokenizer, tokens: tuple[str, ...]) -> tuple[int, ...]:
    """config's classifier_from_token as ids, as vLLM looks them up
    (tokenizer.convert_tokens_to_ids: a token of the vocabulary, e.g. Qwen3's "yes", not the
    ids of a text). ValueError naming a token the vocabulary lacks."""
    if tokenizer is None:
        raise ValueError(f"classifier_from_token {list(tokens)} needs the tokenizer to find the "
                         f"tokens' ids, and this LLM has none (skip_tokenizer_init?)")
    ids = []
    for token in tokens:
        i = tokenizer.convert_tokens_to_ids(token)
        unk = getattr(tokenizer, "unk_token_id", None)
        if not isinstance(i, int) or i < 0 or (i == unk and token != tokenizer.unk_token):
            raise ValueError(f"classifier_from_token {token!r} is not a token of the tokenizer's "
                             f"vocabulary")
        ids.append(i)
    return tuple(ids)


def load_head(model_dir: str, config: ClassifierConfig, hidden_size: int,
              tokenizer) -> ClassifierHead:
    """The classifier head of `model_dir` (state/classifier.py), its tokens looked up in
    `tokenizer` when it is cut from the LM head."""
    ids = classifier_token_ids(tokenizer, config.tokens) if config.method is not None else ()
    return load_classifier_head(model_dir, config, hidden_size, ids)
