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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int

    @classmethod
    def create(cls, config) -> "SpeculativeConfig | None":
        """The config from LLM's speculative_config dict (None: no speculation); ValueError
        for anything but a well-formed "ngram" config."""
        if config is None:
            return None
        if isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(config).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
        unknown = sorted(map(str, set(config) - known))
        if unknown:
            raise ValueError(f"speculative_config: minivllm does not take {unknown} (it takes "
                             f"{sorted(known)})")
        method = config.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {METHODS} (n-gram "
                             f"prompt lookup), got {method!r}")

        def positive(name: str, default=None) -> int:
            value = config.get(name, default)
            if value is None:
                raise ValueError(f"speculative_config: {name} is required for method 'ngram'")
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, got "
                                 f"{value!r}")
            return int(value)

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
