"""Embeddings, as vLLM's pooling runner serves them: `LLM(model, runner="pooling").embed(prompts)`
for Qwen3-Embedding checkpoints. PoolingParams, the outputs of LLM.embed, and which runner a
checkpoint asks for. (The same runner classifies and scores: runtime/classify.py,
runtime/scoring.py.)

An embedding request is an ordinary request of the engine whose sequence ends with its prompt:
the prompt is prefilled as any other (batched with other requests, in chunks, through the prefix
cache), and the step that computes its last token returns that token's final-normed hidden state
instead of sampling one (runner.ModelRunner's head for `StepInput.pooled`); the engine cuts it to
`dimensions` and normalises it (functional/pooling.py) and the request is finished.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

from ..state.classifier import ARCHITECTURE as CLASSIFIER_ARCHITECTURE
from ..state.config import read_config_dict
from ..state.values import as_int

RUNNERS = ("auto", "generate", "pooling")
# vLLM's older `task` argument: the values that name a runner minivllm has.
_TASKS = {"auto": None, "generate": "generate", "embed": "pooling", "embedding": "pooling",
          "classify": "pooling", "score": "pooling"}
# What a pooling request computes (PoolingParams.task, vLLM's pooling tasks): an embedding, a
# classifier's probabilities, or a cross-encoder's score of a pair.
POOLING_TASKS = ("embed", "classify", "score")

_ST_MODULES = "modules.json"  # a sentence-transformers checkpoint's list of modules
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
# The modules a pooled embedding is made of here: a Dense projection (which vLLM and
# sentence-transformers apply after the pooling) or any other would change it, so is refused.
_ST_TAKEN = ("sentence_transformers.models.Transformer", _ST_POOLING, _ST_NORMALIZE)


@dataclass(frozen=True)
class PoolingParams:
    """How to pool one request (vLLM's PoolingParams), checked on creation. dimensions: keep the
    embedding's first `dimensions` features before normalising (Matryoshka; None: all of
    hidden_size). normalize: divide by the L2 norm (None: the model's default, True unless its
    sentence-transformers config has no Normalize module); use_activation is vLLM's newer name
    for it, and for a classifier's probabilities or score the only setting: apply the head's
    activation (softmax, sigmoid) to its logits (None: True). truncate_prompt_tokens: keep only
    the prompt's last k tokens (-1: max_model_len). task: "embed", "classify" or "score" (what
    LLM.embed, LLM.classify and LLM.score set; None: the call's)."""

    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None
    task: str | None = None

    def __post_init__(self):
        def bad(msg):
            raise ValueError(f"PoolingParams: {msg}")

        for name in ("dimensions", "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and as_int(value) is not None:  # numpy / torch integers
                object.__setattr__(self, name, as_int(value))
        if self.dimensions is not None and (as_int(self.dimensions) is None or self.dimensions < 1):
            bad(f"dimensions must be an integer >= 1 or None, got {self.dimensions!r}")
        keep = self.truncate_prompt_tokens
        if keep is not None and (as_int(keep) is None or (keep < 1 and keep != -1)):
            bad(f"truncate_prompt_tokens must be an integer >= 1, -1 (max_model_len) or None, "
                f"got {keep!r}")
        for name in ("normalize", "use_activation"):
            if not isinstance(getattr(self, name), (bool, type(None))):
                bad(f"{name} must be True, False or None, got {getattr(self, name)!r}")
        if None not in (self.normalize, self.use_activation) and \
                self.normalize != self.use_activation:
            bad(f"normalize={self.normalize} and use_activation={self.use_activation} disagree "
                f"(they name one setting)")
        if self.task is not None and self.task not in POOLING_TASKS:
            bad(f"task must be one of {', '.join(map(repr, POOLING_TASKS))} or None, got "
                f"{self.task!r}")
        if self.task in ("classify", "score"):
            self.check_task(self.task)

    def check_task(self, task: str) -> None:
        """ValueError unless these params can serve `task`: one they do not already name
        otherwise, and for a classifier's task no embedding's parameter (vLLM's check)."""
        if self.task is not None and self.task != task:
            raise ValueError(f"PoolingParams: you cannot overwrite task={self.task!r} with "
                             f"{task!r}")
        if task != "embed":
            given = [name for name in ("dimensions", "normalize")
                     if getattr(self, name) is not None]
            if given:
                raise ValueError(f"PoolingParams: task {task!r} only supports use_activation "
                                 f"(and truncate_prompt_tokens), not {given}")

    def for_task(self, task: str) -> "PoolingParams":
        """These params with `task` set, checked (check_task)."""
        self.check_task(task)
        return self if self.task == task else replace(self, task=task)

    def activates(self) -> bool:
        """Whether a classifier's activation applies to its logits (use_activation, default
        True)."""
        return self.use_activation is not False

    def normalizes(self, default: bool) -> bool:
        """Whether the embedding is L2-normalised; `default` when the params leave it open."""
        for value in (self.normalize, self.use_activation):
            if value is not None:
                return value
        return default


@dataclass
class EmbeddingOutput:
    """One prompt's embedding: `dimensions` floats (hidden_size by default)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)

    def __repr__(self) -> str:  # vLLM's: the size, not every float
        return f"EmbeddingOutput(hidden_size={self.hidden_size})"


@dataclass
class EmbeddingRequestOutput:
    """What LLM.embed returns per prompt, as vLLM's: `outputs.embedding`, the prompt's ids (after
    truncate_prompt_tokens), and the prompt tokens found in the prefix cache."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    # vLLM's order (PoolingRequestOutput's arguments and repr)
    num_cached_tokens: int = 0
    finished: bool = True


def sentence_transformers_pooling(model_dir: str) -> dict | None:
    """What a sentence-transformers checkpoint (Qwen3-Embedding is one) says of its pooling, as
    vLLM reads it: {"pooling": "LAST" / "MEAN" / "CLS" / ..., "normalize": bool} from
    modules.json (its Pooling module's config.json, whether a Normalize module follows); None when
    the directory has no such config."""
    path = os.path.join(model_dir, _ST_MODULES)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            modules = json.load(f)
        pooling = next((m for m in modules if m.get("type") == _ST_POOLING), None)
        normalize = any(m.get("type") == _ST_NORMALIZE for m in modules)
        if pooling is None:
            return None
        others = [m.get("type") for m in modules if m.get("type") not in _ST_TAKEN]
        with open(os.path.join(model_dir, pooling.get("path", ""), "config.json")) as f:
            modes = json.load(f)
        if not isinstance(modes, dict):  # its items are read below, out of this try
            raise ValueError(f"its Pooling config.json holds a {type(modes).__name__}, not an "
                             f"object")
    except (OSError, ValueError, AttributeError, TypeError) as e:
        raise ValueError(f"{model_dir}: cannot read its sentence-transformers pooling config "
                         f"({type(e).__name__}: {e})") from None
    if others:
        raise ValueError(f"{model_dir}: its sentence-transformers modules.json lists {others}, "
                         f"which minivllm does not apply (it takes Transformer, Pooling and "
                         f"Normalize): its embeddings would be wrong")
    mode = next((k for k, v in modes.items() if k.startswith("pooling_mode_") and v is True), None)
    if mode is None:
        return None
    name = mode.removeprefix("pooling_mode_")
    name = "LAST" if name == "lasttoken" else name.split("_")[0].upper()  # mean_tokens: MEAN
    return {"pooling": name, "normalize": normalize}


def resolve_runner(runner, task, model_dir: str | None, architectures=()) -> tuple[str, bool]:
    """LLM's runner= and task= -> ("generate" or "pooling", the default of `normalize`), as
    vLLM resolves them: runner="auto" is "pooling" for a sentence-transformers checkpoint (whose
    config names a Pooling module, as Qwen3-Embedding's does, though its config.json says
    Qwen3ForCausalLM), for a bare Qwen3Model and for a Qwen3ForSequenceClassification (as
    config.json says, or hf_overrides make it: `architectures`, the merged config's), else
    "generate". task is vLLM's older form: "embed" (or "embedding"), "classify" and "score" are
    runner="pooling", "generate" runner="generate". model_dir None: random weights, no files to
    read. ValueError for a runner minivllm has not, or a checkpoint the runner cannot serve."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(map(repr, RUNNERS))}, got {runner!r}")
    if task is not None:
        if task not in _TASKS:
            raise ValueError(f"task must be one of {', '.join(map(repr, _TASKS))} (minivllm "
                             f"generates, embeds, classifies and scores), got {task!r}")
        implied = _TASKS[task]
        if implied is not None and runner not in ("auto", implied):
            raise ValueError(f"task={task!r} means runner={implied!r}, but runner={runner!r}")
        runner = implied or runner
    st = sentence_transformers_pooling(model_dir) if model_dir is not None else None
    archs = list(architectures or [])
    if runner == "auto":
        runner = "pooling" if _pooling_reason(st, archs) is not None else "generate"
    if runner == "generate" and "Qwen3Model" in archs:
        raise ValueError(f"{model_dir}: a Qwen3Model checkpoint is the backbone alone, without "
                         f"an LM head: it embeds (runner='pooling') and cannot generate")
    if runner == "generate" and CLASSIFIER_ARCHITECTURE in archs:
        raise ValueError(f"{model_dir}: its config (with any hf_overrides) names "
                         f"{CLASSIFIER_ARCHITECTURE}, "
                         f"which classifies and scores (runner='pooling') and cannot generate")
    if runner == "pooling" and st is not None and st["pooling"] != "LAST":
        raise ValueError(f"{model_dir}: its sentence-transformers config pools {st['pooling']}; "
                         f"minivllm pools the last token (LAST) only")
    return runner, True if st is None else st["normalize"]


def _pooling_reason(st: dict | None, architectures) -> str | None:
    """Why runner="auto" makes a checkpoint a pooling model, in words, or None when it
    generates. st: sentence_transformers_pooling's answer; architectures: the merged config's."""
    archs = list(architectures or [])
    if st is not None:
        return "it is a sentence-transformers (embedding) checkpoint (its modules.json)"
    if "Qwen3Model" in archs:
        return "its config names Qwen3Model, the backbone alone without an LM head"
    if CLASSIFIER_ARCHITECTURE in archs:
        return (f"its config (with any hf_overrides) names {CLASSIFIER_ARCHITECTURE}, a "
                f"classifier")
    return None


def check_generates(model_dir: str, hf_overrides: dict | None, command: str) -> None:
    """ValueError unless runner="auto" makes `model_dir` (with `hf_overrides`) a generating
    model, for `minivllm {command}`, which only generates: said before its engine starts,
    since a pooling engine would load the weights and then refuse the first request. A directory
    without config.json is left to the engine, which names that problem itself."""
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        return
    config = read_config_dict(model_dir, hf_overrides)
    archs = config.get("architectures") if isinstance(config, dict) else None
    reason = _pooling_reason(sentence_transformers_pooling(model_dir), archs)
    if reason is not None:
        raise ValueError(f"{model_dir}: {reason}: a pooling model (embeddings, classification, "
                         f"scores), which `minivllm {command}` cannot run, as it generates "
                         f"text; serve it with `minivllm serve --runner pooling`, or use "
                         f"LLM(..., runner=\"pooling\").embed / .classify / .score")
