"""N-gram speculative decoding (vLLM's speculative_config={"method": "ngram", ...}).

A decoding sequence proposes up to `num_speculative_tokens` (k) draft tokens by prompt lookup:
the longest n-gram (n from prompt_lookup_max down to prompt_lookup_min) that ends its token ids
and occurred earlier in them (prompt and output; the earliest such occurrence, as vLLM's
proposer), and the (up to k) tokens that followed that occurrence. The step then computes the
sequence's last token and its drafts as one chunk, with logits at each of its k + 1 positions,
samples position i with the sequence's own row at step num_output + i (the sampler is seeded per
(seed, step), so exactly as the engine without speculation would sample that token), and accepts
drafts left to right while the sampled token equals the draft; the first mismatch's sampled token
(or the bonus token after all k) is appended as well. For deterministic drafts this is exact
rejection sampling: outputs are those of the engine without speculation, token for token.

Drafts never enter a sequence's token ids until accepted (the prefix cache registers known
tokens only); the K/V a rejected draft wrote lies past the sequence's length and is overwritten
by a later step before anything reads it.

Draft-model speculative decoding (vLLM's {"method": "draft_model", "model": DIR,
"num_speculative_tokens": k}; as vLLM, "model" given without "method" means "draft_model"): a
smaller Qwen3 dense checkpoint of the same vocabulary (Qwen3-0.6B for Qwen3-8B) proposes the
drafts, greedily, and verification is the same as above (so outputs are again those of the
engine without speculation, token for token; only the acceptance rate depends on the draft).
The draft has its own KV cache of the target's num_blocks and block_size, indexed by the same
block tables and slots: no second block manager. Every forward the target runs (prefill chunks,
decodes, verification chunks, recomputes after preemption) is run on the draft too with the same
batch (ModelRunner._mirror), so a slot's draft K/V is that of the token whose target K/V the slot
holds (at every position up to a sequence's length): prefix-cache hits and recomputes hold for
the draft as they do for the target. A decoding sequence whose last token t sits at position n
(in neither cache yet) drafts after the scheduler has grown its table for the drafts: k
one-token greedy forwards of the draft, batched over the step's drafting sequences, [t]@n -> d1,
[d1]@n+1 -> d2, ... (ModelRunner.propose), which write the draft K/V of t, d1..d(k-1); then the
step verifies [t, d1..dk] as a chunk. The rounds are queued, not waited for: the host builds and
launches that step while they run, its inputs take the drafts on the device, and the drafts reach
the host with its sampled tokens, to be compared with them. A step of such chunks only is not
mirrored (the mirror would rewrite those slots with the same tokens): of an accepted prefix t,
d1..da only dk's K/V can be missing, where a = k, and ModelRunner.catch_up writes it with one more
draft forward (LLMEngine._record_spec, before any sequence ends); past a sequence's length a slot
is overwritten before anything reads it. A step with other chunks (prompts, rows without drafts) is
mirrored whole. Where the target captures decode CUDA graphs, the draft has decode graphs of
its own, captured into the target's graph memory pool (the graphs of one pool replay one at a
time on one stream): propose's and catch_up's rounds replay them, as do mirrored decode steps;
a mirrored verification step the target replays from a verification graph
(runtime/prefill_graph.py) is mirrored by the draft's graph over the same inputs; other mirrored
steps run the draft's own compiled forward where the target's is compiled; elsewhere (CPU,
enforce_eager) the draft runs eagerly. Sleep mode (runtime/sleep.py) frees the draft's weights
and cache with the target's and captures its graphs again on waking; level 2 is refused with a
draft model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

METHODS = ("ngram", "draft_model")
# The "model" (and "method") vLLM takes for n-gram speculation.
NGRAM_NAMES = ("ngram", "[ngram]")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int  # ngram's (0 for draft_model)
    prompt_lookup_min: int
    model: str | None = None  # draft_model's checkpoint directory
    # draft_model's ModelConfig (EngineConfig.create reads and checks it against the target's)
    draft_config: object = None

    @classmethod
    def create(cls, config) -> "SpeculativeConfig | None":
        """The config from LLM's speculative_config dict (None: no speculation); ValueError
        for anything but a well-formed "ngram" or "draft_model" config (the draft checkpoint
        itself is read and checked by EngineConfig.create, check_draft_model)."""
        if config is None:
            return None
        if isinstance(config, SpeculativeConfig):
            # A hand-built instance is checked as its dict is (it skipped every check: k = 0,
            # min > max and unknown methods ran); the draft's ModelConfig is read again by
            # EngineConfig.create.
            fields = {"method": config.method,
                      "num_speculative_tokens": config.num_speculative_tokens}
            if config.model is not None:
                fields["model"] = config.model
            if config.method != "draft_model" or config.prompt_lookup_max or \
                    config.prompt_lookup_min:
                fields |= {"prompt_lookup_max": config.prompt_lookup_max,
                           "prompt_lookup_min": config.prompt_lookup_min}
            config = fields
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(config).__name__}")
        known = {"method", "model", "num_speculative_tokens", "prompt_lookup_max",
                 "prompt_lookup_min", "draft_tensor_parallel_size"}
        unknown = sorted(map(str, set(config) - known))
        if unknown:
            raise ValueError(f"speculative_config: minivllm does not take {unknown} (it takes "
                             f"{sorted(known)})")
        # As vLLM's SpeculativeConfig fields: None stands for a key not given (its defaults).
        config = {key: value for key, value in config.items() if value is not None}
        method, model = config.get("method"), config.get("model")
        if method is None and model is not None:
            # as vLLM: a model given without a method is a draft model, but for "ngram"
            method = "ngram" if model in NGRAM_NAMES else "draft_model"
        if method == "[ngram]":  # vLLM's other spelling
            method = "ngram"
        if method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {METHODS} (n-gram "
                             f"prompt lookup, or a draft model named by \"model\"), got "
                             f"{method!r}")

        def positive(name: str, default=None) -> int:
            value = config.get(name, default)
            if value is None:
                raise ValueError(f"speculative_config: {name} is required for method {method!r}")
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, got "
                                 f"{value!r}")
            return int(value)

        tp = config.get("draft_tensor_parallel_size")
        if tp is not None and (isinstance(tp, bool) or tp != 1):
            raise ValueError(f"speculative_config: draft_tensor_parallel_size must be 1 (minivllm "
                             f"runs the draft on one device), got {tp!r}")
        if method == "draft_model":
            lookup = sorted(n for n in ("prompt_lookup_max", "prompt_lookup_min") if n in config)
            if lookup:
                raise ValueError(f"speculative_config: method 'draft_model' does not take "
                                 f"{lookup} (n-gram's)")
            if not isinstance(model, (str, os.PathLike)) or not os.fspath(model):
                raise ValueError(f"speculative_config: method 'draft_model' needs \"model\", the "
                                 f"draft checkpoint's directory, got {model!r}")
            k = positive("num_speculative_tokens")
            return cls(method, k, 0, 0, model=os.fspath(model))
        if model is not None and model not in NGRAM_NAMES:  # vLLM's ngram config names one
            raise ValueError(f"speculative_config: method 'ngram' does not take a \"model\" "
                             f"(got {model!r}); a draft model is method 'draft_model'")
        k = positive("num_speculative_tokens")
        # As vLLM: one of the lookup bounds given stands for both where the other is missing,
        # and 5 for both where neither is.
        lo, hi = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
        if lo is not None:  # checked as itself before it stands for a missing max
            lo = positive("prompt_lookup_min")
        hi = positive("prompt_lookup_max", 5 if lo is None else lo)
        lo = positive("prompt_lookup_min", hi)
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) must be <= "
                             f"prompt_lookup_max ({hi})")
        return cls(method, k, hi, lo)


def ngram_propose(token_ids, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k draft tokens for a sequence of `token_ids` by prompt lookup: for the largest n in
    [min_n, max_n] such that the last n tokens occur earlier (an occurrence ending before the
    last token; it may overlap the suffix), the tokens that follow the earliest occurrence, at
    most k of them (fewer where the sequence ends first). [] when no n-gram matches."""
    length = len(token_ids)
    if k < 1 or length < min_n + 1:
        return []
    arr = np.asarray(token_ids, dtype=np.int64)
    head = arr[:length - 1]  # an occurrence must end before the last token
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = arr[length - n:]
        # candidate starts j in [0, length - n - 1] whose first token matches, then the rest
        cand = np.flatnonzero(head[:length - n] == suffix[0])
        for i in range(1, n):
            if not cand.size:
                break
            cand = cand[head[cand + i] == suffix[i]]
        if cand.size:
            start = int(cand[0]) + n
            return arr[start:start + k].tolist()
    return []
