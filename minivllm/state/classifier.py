"""The head of a Qwen3ForSequenceClassification model, as vLLM's pooling runner reads it: the
weight that turns the final-normed hidden state at a prompt's last token into `num_labels`
logits, and the activations that turn those into what LLM.classify and LLM.score return.

Two layouts load, as vLLM's `as_seq_cls_model` loads them (model_executor/models/adapters.py):
- a Qwen3ForSequenceClassification checkpoint: `score.weight` [num_labels, hidden] beside the
  backbone (transformers' `score`, a linear layer without bias);
- a Qwen3ForCausalLM checkpoint made a classifier by hf_overrides, as the original
  Qwen3-Reranker is: {"architectures": ["Qwen3ForSequenceClassification"],
  "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}. The head is cut
  from the LM head's rows of those tokens (the embedding's when the checkpoint ties them):
  method "from_2_way_softmax" (what is_original_qwen3_reranker sets) makes one label whose
  weight is row(yes) - row(no), so that sigmoid of its logit is softmax(logit_no, logit_yes)[yes]
  (the reranker's P(yes)); "no_post_processing" keeps the rows, a label each.

The weight is float32 whatever the checkpoint's dtype (vLLM's head_dtype): the row difference
and the logits are computed in float32.
"""

from __future__ import annotations

import attrs
import torch

from .load import CheckpointError, _FLOAT_DTYPES, _index_tensors, _open, backbone_prefix

ARCHITECTURE = "Qwen3ForSequenceClassification"
METHODS = ("from_2_way_softmax", "no_post_processing")
# A cross-encoder's sentence-transformers activation (config's sentence_transformers.activation_fn
# or sbert_ce_default_activation_function) -> what vLLM applies for it: Sigmoid and Softmax both
# become its default classification activation (PoolerActivation.wraps).
_ST_ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity",
                   "torch.nn.modules.activation.Sigmoid": None,
                   "torch.nn.modules.activation.Softmax": None}


@attrs.frozen
class ClassifierConfig:
    """What config.json (hf_overrides merged) says of the head. method: None (the checkpoint's
    score.weight) or one of METHODS (cut from the LM head's rows of `tokens`). tied: the
    checkpoint's tie_word_embeddings (whether those rows are the embedding's). classify_activation
    / score_activation: "softmax", "sigmoid" or "identity" (functional/classify.py), for
    LLM.classify and LLM.score. labels: id2label's names in label order. use_sep_token: how
    LLM.score joins a pair of texts (vLLM's use_sep_token, formerly use_pad_token):
    tokenizer(text, text_pair) when true, else tokenizer(text_1 + text_2), the default of a
    classifier cut from an LM head."""

    num_labels: int
    method: str | None = None
    tokens: tuple[str, ...] = ()
    tied: bool = False
    classify_activation: str = "softmax"
    score_activation: str = "softmax"
    labels: tuple[str, ...] = ()
    use_sep_token: bool = True

    @classmethod
    def from_dict(cls, d: dict) -> "ClassifierConfig | None":
        """The head's config from a config dict; None unless its architectures name
        Qwen3ForSequenceClassification. ValueError naming the key that is wrong."""
        if ARCHITECTURE not in (d.get("architectures") or []):
            return None
        tokens = d.get("classifier_from_token")
        if tokens is not None and (not isinstance(tokens, list) or not tokens or
                                   not all(isinstance(t, str) for t in tokens)):
            raise ValueError(f"config classifier_from_token must be a list of token strings, "
                             f"got {tokens!r}")
        method = d.get("method")
        original = d.get("is_original_qwen3_reranker", False)
        if original not in (True, False):
            raise ValueError(f"config is_original_qwen3_reranker must be true or false, got "
                             f"{original!r}")
        if original:  # vLLM's Qwen3ForSequenceClassificationConfig
            if tokens is None or len(tokens) != 2:
                raise ValueError(f"is_original_qwen3_reranker needs classifier_from_token, the "
                                 f"two tokens whose logits it compares (Qwen3-Reranker's: "
                                 f"[\"no\", \"yes\"]), got {tokens!r}")
            method = "from_2_way_softmax"
        if method is not None and method not in METHODS:
            raise ValueError(f"config method must be one of {', '.join(METHODS)}, got {method!r}")
        if (method is None) != (tokens is None):
            raise ValueError(f"config classifier_from_token and method go together (a head cut "
                             f"from the LM head's rows of those tokens), got "
                             f"classifier_from_token={tokens!r} and method={method!r}")
        if method == "from_2_way_softmax" and len(tokens) != 2:
            raise ValueError(f"method from_2_way_softmax compares two tokens (false, then true), "
                             f"got classifier_from_token={tokens!r}")
        if method == "from_2_way_softmax":
            num_labels = 1
        elif method == "no_post_processing":
            num_labels = len(tokens)
        else:
            num_labels = _num_labels(d)
        labels = _labels(d, num_labels)
        tie = d.get("tie_word_embeddings", False)
        if tie not in (True, False):
            raise ValueError(f"config tie_word_embeddings must be true or false, got {tie!r}")
        sep = d.get("use_sep_token", d.get("use_pad_token"))
        if sep not in (True, False, None):
            raise ValueError(f"config use_sep_token must be true or false, got {sep!r}")
        default = _default_activation(num_labels)
        return cls(num_labels=num_labels, method=method, tokens=tuple(tokens or ()), tied=tie,
                   classify_activation=_classify_activation(d, default),
                   score_activation=_score_activation(d, default), labels=labels,
                   use_sep_token=(method is None) if sep is None else sep)


def _num_labels(d: dict) -> int:
    """As transformers reads it: id2label's size, else num_labels (transformers 5 writes null
    there), else transformers' default of 2."""
    id2label, n = d.get("id2label"), d.get("num_labels")
    if isinstance(id2label, dict) and id2label:
        n = len(id2label)
    elif n is None:
        n = 2
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"config num_labels must be a positive integer, got {n!r}")
    return n


def _labels(d: dict, num_labels: int) -> tuple[str, ...]:
    """id2label's names in label order (its keys are "0".."n-1" in JSON); transformers'
    LABEL_i where the config has none for this many labels."""
    id2label = d.get("id2label")
    if not isinstance(id2label, dict) or len(id2label) != num_labels:
        return tuple(f"LABEL_{i}" for i in range(num_labels))
    try:
        names = {int(k): v for k, v in id2label.items()}
    except (TypeError, ValueError):
        names = {}
    if sorted(names) != list(range(num_labels)) or not all(isinstance(v, str)
                                                          for v in names.values()):
        raise ValueError(f"config id2label must map 0..{num_labels - 1} to label names, got "
                         f"{id2label!r:.120}")
    return tuple(names[i] for i in range(num_labels))


def _default_activation(num_labels: int) -> str:
    """vLLM's PoolerClassify: sigmoid for one label (a score), softmax over two or more."""
    return "sigmoid" if num_labels < 2 else "softmax"


def _classify_activation(d: dict, default: str) -> str:
    """LLM.classify's, as vLLM's get_classification_activation_function reads config's
    problem_type (transformers' loss for it): regression none, multi-label a sigmoid per label."""
    kind = d.get("problem_type")
    if kind == "regression":
        return "identity"
    if kind == "multi_label_classification":
        return "sigmoid"
    if kind not in (None, "single_label_classification"):
        raise ValueError(f"config problem_type must be regression, single_label_classification "
                         f"or multi_label_classification, got {kind!r}")
    return default


def _score_activation(d: dict, default: str) -> str:
    """LLM.score's, as vLLM's get_cross_encoder_activation_function: a sentence-transformers
    cross-encoder's activation_fn where the config names one, else the default."""
    st = d.get("sentence_transformers")
    name = (st.get("activation_fn") if isinstance(st, dict) else None) or \
        d.get("sbert_ce_default_activation_function")
    if name is None:
        return default
    if name not in _ST_ACTIVATIONS:
        raise ValueError(f"config names the cross-encoder activation {name!r}; minivllm applies "
                         f"{', '.join(_ST_ACTIVATIONS)}")
    return _ST_ACTIVATIONS[name] or default


@attrs.frozen
class ClassifierHead:
    """The loaded head: weight [num_labels, hidden] float32 and its config."""

    weight: torch.Tensor
    config: ClassifierConfig

    @property
    def num_labels(self) -> int:
        return self.config.num_labels


def load_classifier_head(path: str, config: ClassifierConfig, hidden_size: int,
                         token_ids: tuple[int, ...] = ()) -> ClassifierHead:
    """The head from checkpoint directory `path`: score.weight, or for a config with a method
    the rows `token_ids` (config.tokens' ids, in order) of lm_head.weight (of the embedding when
    config.tied), combined as the method says. Reads those rows only. CheckpointError naming the
    tensor that is missing, mis-shaped or not float."""
    files = _index_tensors(path)
    if config.method is None:
        handle, sl = _read(files, path, "score.weight", (config.num_labels, hidden_size))
        weight = sl[:].float()  # [num_labels, hidden], read while its file is open
        del handle
        return ClassifierHead(weight=weight, config=config)
    if len(token_ids) != len(config.tokens):
        raise ValueError(f"{len(config.tokens)} classifier tokens {list(config.tokens)} but "
                         f"{len(token_ids)} token ids")
    name = (backbone_prefix(files) + "embed_tokens.weight") if config.tied else "lm_head.weight"
    handle, table = _read(files, path, name, None)  # the handle kept open while rows are read
    vocab, hidden = table.get_shape()
    if hidden != hidden_size:
        raise CheckpointError(f"{path}: tensor {name} has shape {[vocab, hidden]}, expected "
                              f"[vocab_size, {hidden_size}]")
    for token, i in zip(config.tokens, token_ids):
        if not 0 <= i < vocab:
            raise ValueError(f"classifier token {token!r} has id {i}, outside {name}'s "
                             f"{vocab} rows")
    rows = torch.cat([table[i:i + 1] for i in token_ids]).float()  # [tokens, hidden]
    del handle
    if config.method == "from_2_way_softmax":
        rows = rows[1:2] - rows[0:1]  # true - false: one logit, sigmoid of it P(true)
    return ClassifierHead(weight=rows, config=config)


def _read(files: dict, path: str, name: str, shape: tuple[int, ...] | None):
    """(the open file, the safetensors slice) of tensor `name`, its shape and dtype checked."""
    if name not in files:
        what = ("a Qwen3ForSequenceClassification checkpoint's head" if name == "score.weight"
                else "the LM head the classifier tokens' rows are cut from")
        raise CheckpointError(f"{path}: missing tensor {name} ({what})")
    handle = _open(files[name])
    try:
        sl = handle.get_slice(name)
        stored, got = sl.get_dtype(), tuple(sl.get_shape())
    except Exception as e:
        raise CheckpointError(f"{files[name]}: cannot read tensor {name} ({e})") from e
    if shape is not None and got != shape:
        raise CheckpointError(f"{files[name]}: tensor {name} has shape {got}, expected {shape} "
                              f"([num_labels, hidden_size])")
    if stored not in _FLOAT_DTYPES:
        raise CheckpointError(f"{files[name]}: tensor {name} is stored as {stored}; the "
                              f"classifier head is read from F32/F16/BF16 weights")
    return handle, sl
