"""A checkpoint's generation_config.json: its EOS ids, and the sampling defaults its authors
recommend (Qwen3: temperature 0.6, top_p 0.95, top_k 20).

As in vLLM (>= 0.8, `generation_config="auto"`), the recommended values become the sampling
parameters of requests that give none; a request that passes a SamplingParams gets exactly
those, so nano-vllm-style calls, which always pass one, are unaffected. "vllm" ignores the
file's sampling keys (not its EOS ids); a directory's file replaces the model's for both.
override_generation_config (serve's --override-generation-config) sets values over either; its
max_new_tokens also caps a server request's own max_tokens, as vLLM's (override_max_tokens).
"""

from __future__ import annotations

import json
import os
from typing import Mapping

FILE = "generation_config.json"

# generation_config.json's keys that set a SamplingParams field (vLLM reads the same ones);
# transformers' max_new_tokens is SamplingParams' max_tokens.
SAMPLING_KEYS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature",
                 "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                 "max_new_tokens": "max_tokens"}


def read_generation_config(directory: str) -> dict:
    """directory's generation_config.json as a dict; {} when there is none. A malformed file is
    named, not skipped: skipping it could drop the EOS id that stops generation (Qwen3's
    <|im_end|> is only there)."""
    path = os.path.join(directory, FILE)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            gen = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read it as JSON ({e})") from None
    if not isinstance(gen, dict):
        raise ValueError(f"{path}: must hold a JSON object, got {type(gen).__name__}")
    return gen


def eos_ids_of(gen: Mapping, where: str) -> list[int]:
    """The ids of gen's eos_token_id (an id, a list of them, or null)."""
    eos = gen.get("eos_token_id")
    listed = eos if isinstance(eos, list) else [eos]  # a null entry names no id
    if not all(i is None or (isinstance(i, int) and not isinstance(i, bool) and i >= 0)
               for i in listed):
        raise ValueError(f"{where}: eos_token_id must be a token id or a list of them, got {eos!r}")
    return [i for i in listed if i is not None]


def generation_config_dir(generation_config, model: str, model_is_file_free: bool) -> str | None:
    """The directory whose generation_config.json `LLM(generation_config=...)` names, checked:
    the model's for "auto" and "vllm" (which still takes its EOS ids, as vLLM does; None for
    random weights), else the directory given."""
    if not isinstance(generation_config, (str, os.PathLike)):
        raise TypeError(f"generation_config must be 'auto', 'vllm' or a directory, got "
                        f"{type(generation_config).__name__}")
    if generation_config in ("auto", "vllm"):
        return None if model_is_file_free else model
    directory = os.fspath(generation_config)
    if not os.path.isdir(directory):
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory holding "
                         f"{FILE}; {directory!r} is not a directory")
    if not os.path.isfile(os.path.join(directory, FILE)):
        raise ValueError(f"generation_config directory {directory!r} has no {FILE}")
    return directory


def sampling_defaults(gen: Mapping, override: Mapping | None, where: str) -> dict:
    """SamplingParams keyword arguments from gen's sampling keys (null ones left out), then
    `override`'s (vLLM's override_generation_config: a null unsets the file's value; its keys
    must be sampling keys, as a typo would otherwise be ignored without a word). Each source is
    checked by building a SamplingParams, and an error names it (`where`: gen's file)."""
    from .sampling_params import SamplingParams

    if override is None:
        override = {}
    if not isinstance(override, Mapping):
        raise TypeError(f"override_generation_config must be a dict, got {type(override).__name__}")
    unknown = sorted(set(override) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(f"override_generation_config: unknown keys {unknown}; it sets "
                         f"{sorted(SAMPLING_KEYS)}")
    kwargs: dict = {}
    for source, values in ((where, gen), ("override_generation_config", override)):
        kwargs.update({SAMPLING_KEYS[k]: values[k] for k in SAMPLING_KEYS if k in values})
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        try:
            SamplingParams(**kwargs)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None
    return kwargs


def override_max_tokens(generation_config, override: Mapping | None,
                        defaults: Mapping) -> int | None:
    """The most tokens vLLM's server lets any request generate, even one whose own max_tokens
    asks for more (OpenAIServingChat / OpenAIServingCompletion's override_max_tokens, which
    get_max_tokens takes the least of): with generation_config "auto" or "vllm", the override's
    max_new_tokens (--override-generation-config); with a directory, the max_tokens it gives
    after the override (`defaults`: sampling_defaults' result). None: no such cap."""
    if generation_config in ("auto", "vllm"):
        return (override or {}).get("max_new_tokens")
    return defaults.get("max_tokens")
