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


def _check_prompts(tokens, vocab_size: int, embeds: list | None = None) -> list[list[int]]:
    """The prompts' ids; a prompt given as embeddings (embeds[i] not None, tokens[i] None)
    gets placeholder ids, one a row (id 0: the stem takes the embeddings at those rows)."""
    if isinstance(tokens, torch.Tensor):
        raise TypeError("tokens must be a list of prompts (lists of ints), not a tensor; "
                        "use tensor.tolist()")
    if not isinstance(tokens, (list, tuple)) or not tokens:
        raise ValueError("tokens must be a non-empty list of prompts (lists of token ids)")
    if embeds is not None and len(embeds) != len(tokens):
        raise ValueError(f"prompt_embeds must hold one entry a prompt ({len(tokens)}), got "
                         f"{len(embeds)}")
    prompts = []
    for i, prompt in enumerate(tokens):
        if embeds is not None and embeds[i] is not None:
            if prompt is not None:
                raise ValueError(f"prompt {i} is given as prompt_embeds: its tokens entry must "
                                 f"be None (its ids are the embeddings' rows)")
            prompts.append([0] * len(embeds[i]))
            continue
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


def _check_embeds(prompt_embeds, hidden_size: int, dtype: torch.dtype) -> list | None:
    """prompt_embeds (None, or per prompt None or a float tensor [T, hidden_size]) -> the
    tensors detached in the model's dtype (None where a prompt is ids), or a named error; the
    checks the engine makes of vLLM's {"prompt_embeds"} prompts (engine._prompt_embeds)."""
    if prompt_embeds is None:
        return None
    if isinstance(prompt_embeds, torch.Tensor) or not isinstance(prompt_embeds, (list, tuple)):
        raise TypeError("prompt_embeds must be a list with one entry a prompt (None or a tensor "
                        "[tokens, hidden_size]), not " + type(prompt_embeds).__name__)
    out = []
    for i, e in enumerate(prompt_embeds):
        if e is None:
            out.append(None)
            continue
        if not isinstance(e, torch.Tensor) or not e.dtype.is_floating_point:
            raise TypeError(f"prompt_embeds[{i}] must be a floating-point tensor, got "
                            f"{getattr(e, 'dtype', type(e).__name__)}")
        if e.ndim != 2 or e.shape[1] != hidden_size or e.shape[0] == 0:
            raise ValueError(f"prompt_embeds[{i}] must be [tokens >= 1, hidden_size="
                             f"{hidden_size}], got shape {list(e.shape)}")
        # On the host: make_batch packs the step's rows there (one copy to the device a step).
        e = e.detach().to("cpu", dtype)
        if not torch.isfinite(e).all():  # a NaN would reach every row of the batch's attention
            raise ValueError(f"prompt_embeds[{i}] holds non-finite values (in {dtype})")
        out.append(e)
    return out


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


def generate(params: Params, cache: KVCache, tokens: Sequence[Sequence[int] | None], *,
             max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None,
             eos_token_id: int | Sequence[int] | None = None,
             backend: AttentionBackend | str | None = None,
             prompt_embeds: Sequence[torch.Tensor | None] | None = None
             ) -> tuple[list[list[int]], KVCache]:
    """Generate up to `max_new_tokens` for each prompt in `tokens` (lists of ids, any lengths,
    batched without padding). Returns each prompt's new tokens (ending with the EOS token when one
    stopped it) and the cache, which is donated: use the returned one.

    prompt_embeds (vLLM's prompt embeddings): one entry a prompt, None or a float tensor
    [T_i, hidden_size] of input embeddings that prompt i is given as instead of ids (its tokens
    entry then None); cast to the model's dtype, they go through Batch.input_embeds /
    embeds_mask as the engine's do. Its generated tokens are fed back as ids.

    Greedy when temperature == 0 (or below 1e-5, as in vLLM), else sampled with top_k / top_p;
    `seed` makes the draw reproducible (prompt i uses its own stream, independent of the other
    prompts). Prompt i uses cache blocks laid out one prompt after the other from block 0."""
    from ..kernels import select_backend

    max_new_tokens, temperature, top_k, top_p, seed = _check_options(
        max_new_tokens, temperature, top_k, top_p, seed)
    check_params(params)
    check_cache_fits(params, cache)
    embeds = _check_embeds(prompt_embeds, params.config.hidden_size, params.dtype)
    prompts = _check_prompts(tokens, params.config.vocab_size, embeds)
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
                         f"YaRN original_max_position_embeddings x factor, or with linear or "
                         f"dynamic scaling max_position_embeddings x factor)")

    # Each prompt draws from its own counter-based stream (seed, tokens generated so far), the
    # sampler the engine uses: the same seed gives the same tokens whatever else is batched.
    # A fresh seed from the OS, not torch.seed(): that would reseed torch's global generator.
    base_seed = seed if seed is not None else secrets.randbits(64)
    seeds = [(base_seed + i * 0x9E3779B97F4A7C15) & ((1 << 64) - 1) for i in range(len(prompts))]

    device, vocab = params.device, params.config.vocab_size
    outputs: list[list[int]] = [[] for _ in prompts]
    chunks = [SeqChunk(p, 0, t) for p, t in zip(prompts, tables)]
    # The prefill's (row, embeddings [T_i, hidden]) pairs: prompt i's rows start after the
    # prompts before it; the decode steps' inputs are all ids.
    starts = np.cumsum([0] + [len(p) for p in prompts[:-1]]).tolist()
    step_embeds = [(row, e) for row, e in zip(starts, embeds or []) if e is not None]
    active = list(range(len(prompts)))
    while True:
        batch = make_batch(chunks, block_size=bs, device=device, check=False,  # checked above
                           embeds=step_embeds, hidden_size=params.config.hidden_size,
                           embeds_dtype=params.dtype)
        step_embeds = []
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
