"""generate(params, cache, tokens): the research entry point, built only from the pure functions:
one batched prefill of all prompts, then batched decode steps until every prompt is done."""

from __future__ import annotations

import secrets
from typing import Iterable, Sequence

import numpy as np

import torch

from ..state.batch import SeqChunk, make_batch
from ..state.cache import KVCache, check_cache_fits
from ..state.config import ceil_div
from ..state.params import Params, check_params
from ..state.values import as_int, as_real
from .attention import AttentionBackend
from .model import forward
from .sampling import SamplingRow, make_sampling_batch, sample


def _check_prompts(tokens, vocab_size: int) -> list[list[int]]:
    if isinstance(tokens, torch.Tensor):
        raise TypeError("tokens must be a list of prompts (lists of ints), not a tensor; "
                        "use tensor.tolist()")
    if not isinstance(tokens, (list, tuple)) or not tokens:
        raise ValueError("tokens must be a non-empty list of prompts (lists of token ids)")
    prompts = []
    for i, prompt in enumerate(tokens):
        if isinstance(prompt, int) or not isinstance(prompt, (list, tuple)):
            raise TypeError(f"prompt {i} must be a list of token ids, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError(f"prompt {i} is empty")
        ids = []
        for t in prompt:
            t_int = as_int(t)
            if t_int is None:
                raise TypeError(f"prompt {i} holds {t!r}, not an int token id")
            if not 0 <= t_int < vocab_size:
                raise ValueError(f"prompt {i} holds token id {t_int}, outside the vocabulary "
                                 f"[0, {vocab_size})")
            ids.append(t_int)
        prompts.append(ids)
    return prompts


def _check_options(max_new_tokens, temperature, top_k, top_p, seed) -> tuple:
    """The options as Python numbers (numpy and torch scalars taken), or a named error."""
    new = as_int(max_new_tokens)
    if new is None or new < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    temp = as_real(temperature)
    if temp is None or not 0 <= temp <= torch.finfo(torch.float32).max:
        raise ValueError(f"temperature must be a number in [0, 3.4e38] (fp32's range), got "
                         f"{temperature!r}")
    k = None if top_k is None else as_int(top_k)
    if top_k is not None and (k is None or k < 1):
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
    p = None if top_p is None else as_real(top_p)
    if top_p is not None and (p is None or not 0 < p <= 1):
        raise ValueError(f"top_p must be a number in (0, 1] or None, got {top_p!r}")
    s = None if seed is None else as_int(seed)
    if seed is not None and s is None:
        raise TypeError(f"seed must be an integer or None, got {seed!r}")
    return new, temp, k, p, s


def _check_eos(eos_token_id, vocab_size: int) -> set[int]:
    """eos_token_id: None, an id or a sequence of ids -> the set of ids that end a prompt."""
    if eos_token_id is None:
        return set()
    ids = [eos_token_id] if as_int(eos_token_id) is not None else eos_token_id
    if isinstance(ids, np.ndarray):
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise TypeError(f"eos_token_id must be an int, a sequence of ints or None, got {eos_token_id!r}")
    eos = set()
    for t in ids:
        t_int = as_int(t)
        if t_int is None:
            raise TypeError(f"eos_token_id holds {t!r}, not an int token id")
        if not 0 <= t_int < vocab_size:
            raise ValueError(f"eos_token_id {t_int} is outside the vocabulary [0, {vocab_size})")
        eos.add(t_int)
    return eos


def generate(params: Params, cache: KVCache, tokens: Sequence[Sequence[int]], *, max_new_tokens: int,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             seed: int | None = None, eos_token_id: int | Sequence[int] | None = None,
             backend: AttentionBackend | str | None = None) -> tuple[list[list[int]], KVCache]:
    """Generate up to `max_new_tokens` for each prompt in `tokens` (lists of ids, any lengths,
    batched without padding). Returns each prompt's new tokens (ending with the EOS token when one
    stopped it) and the cache, which is donated: use the returned one.

    Greedy when temperature == 0 (or below 1e-5, as in vLLM), else sampled with top_k / top_p;
    `seed` makes the draw reproducible (prompt i uses its own stream, independent of the other
    prompts). Prompt i uses cache blocks laid out one prompt after the other from block 0."""
    from ..kernels import select_backend

    max_new_tokens, temperature, top_k, top_p, seed = _check_options(
        max_new_tokens, temperature, top_k, top_p, seed)
    check_params(params)
    check_cache_fits(params, cache)
    prompts = _check_prompts(tokens, params.config.vocab_size)
    eos = _check_eos(eos_token_id, params.config.vocab_size)
    # What leaves a backend out: an fp8 cache (flash_attn), a head_dim triton does not compile for.
    backend = select_backend(params.device, backend, cache.k[0].dtype, params.config.head_dim)

    # The last sampled token is never fed back, so a prompt needs len + max_new - 1 slots.
    bs = cache.block_size
    tables, next_block = [], 0
    for prompt in prompts:
        n = ceil_div(len(prompt) + max_new_tokens - 1, bs)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    if next_block > cache.num_blocks:
        raise ValueError(f"the cache is too small: these prompts need {next_block} blocks of "
                         f"{bs} tokens, the cache has {cache.num_blocks}")
    if max(len(p) for p in prompts) + max_new_tokens - 1 > params.config.max_context_len:
        raise ValueError(f"prompt + max_new_tokens - 1 exceeds the model's context "
                         f"({params.config.max_context_len}: max_position_embeddings, or with "
                         f"YaRN original_max_position_embeddings x factor)")

    # Each prompt draws from its own counter-based stream (seed, tokens generated so far), the
    # sampler the engine uses: the same seed gives the same tokens whatever else is batched.
    # A fresh seed from the OS, not torch.seed(): that would reseed torch's global generator.
    base_seed = seed if seed is not None else secrets.randbits(64)
    seeds = [(base_seed + i * 0x9E3779B97F4A7C15) & ((1 << 64) - 1) for i in range(len(prompts))]

    device, vocab = params.device, params.config.vocab_size
    outputs: list[list[int]] = [[] for _ in prompts]
    chunks = [SeqChunk(p, 0, t) for p, t in zip(prompts, tables)]
    active = list(range(len(prompts)))
    while True:
        batch = make_batch(chunks, block_size=bs, device=device, check=False)  # checked above
        with torch.no_grad():
            logits, cache = forward(params, cache, batch, backend)
        rows = [SamplingRow(temperature=float(temperature), top_k=min(top_k or 0, vocab),
                            top_p=float(top_p or 1.0),
                            seed=seeds[i], step=len(outputs[i])) for i in active]
        sb = make_sampling_batch(rows, vocab_size=params.config.vocab_size, device=device)
        next_tokens = sample(logits, sb).token_ids.tolist()
        still = []
        for i, tok in zip(active, next_tokens):
            outputs[i].append(tok)
            if tok not in eos and len(outputs[i]) < max_new_tokens:
                still.append(i)
        if not still:
            return outputs, cache
        active = still
        chunks = [SeqChunk([outputs[i][-1]], len(prompts[i]) + len(outputs[i]) - 1, tables[i])
                  for i in active]
