"""Choosing the attention backend: once, by device and what is installed.

Order of preference on CUDA: flash_attn (flash-attn-4) when importable, then triton; everywhere
else: reference. Under TRITON_INTERPRET=1 the triton backend is also available on CPU (tests and
CI run it with MINIVLLM_ATTENTION_BACKEND=triton). `MINIVLLM_ATTENTION_BACKEND` (or an explicit
name) overrides the choice; asking for a backend that is not available is a ValueError.
"""

from __future__ import annotations

import logging
import os

import torch

from ..functional.attention import REFERENCE
from ..state.config import FP8_DTYPES
from .launch import runs_ptx, triton_usable

log = logging.getLogger("minivllm")
BACKEND_NAMES = ("triton", "flash_attn", "reference")
_logged: set[tuple[str, str]] = set()
# head_dim the Triton kernels compile for on a GPU: tl.dot's least K is 16, and past 256 the
# decode kernel's tiles overflow the H200's shared memory (at 512: 283 KB of 227).
TRITON_HEAD_DIMS = (16, 256)


def triton_takes_head_dim(head_dim: int) -> bool:
    """Whether the Triton kernels compile for `head_dim` on a GPU (the interpreter runs any)."""
    lo, hi = TRITON_HEAD_DIMS
    return lo <= head_dim <= hi


_FP8_FLASH_ATTN = ("attention backend 'flash_attn' reads a KV cache in the model's dtype; "
                   "kv_cache_dtype fp8 needs 'triton' or 'reference'")


def available_backends(device) -> list[str]:
    """Usable backend names for `device`, best first."""
    device = torch.device(device)
    names = []
    if device.type == "cuda":
        from .flash_attn_backend import flash_attn_varlen

        if flash_attn_varlen() is not None:
            names.append("flash_attn")
    if device.type == "cuda":
        names.append("triton")
    names.append("reference")
    # Under Triton's interpreter the kernels also run on the CPU (slowly): available when asked
    # for, never the default there.
    if device.type != "cuda" and triton_usable(device):
        names.append("triton")
    return names


def _make(name: str):
    if name == "reference":
        return REFERENCE
    if name == "triton":
        from .triton_backend import TRITON

        return TRITON
    if name == "flash_attn":
        from .flash_attn_backend import FLASH_ATTN

        return FLASH_ATTN
    raise ValueError(f"unknown attention backend {name!r}; choose from {', '.join(BACKEND_NAMES)}")


def backend_name(device, requested: str | None = None, cache_dtype: torch.dtype | None = None,
                 head_dim: int | None = None) -> str:
    """The name select_backend picks for a name or None (see there), or its ValueError; pure,
    so the engine's options can follow the backend before anything is built."""
    name = requested or os.environ.get("MINIVLLM_ATTENTION_BACKEND") or None
    available = available_backends(device)
    if cache_dtype in FP8_DTYPES:
        if name == "flash_attn":
            raise ValueError(_FP8_FLASH_ATTN)
        available = [n for n in available if n != "flash_attn"]
    if head_dim is not None and runs_ptx(torch.device(device)) and not triton_takes_head_dim(head_dim):
        if name == "triton":
            lo, hi = TRITON_HEAD_DIMS
            raise ValueError(f"attention backend 'triton' takes head_dim {lo}-{hi} on a GPU, got "
                             f"{head_dim}; use 'reference'")
        available = [n for n in available if n != "triton"]
    if name is None:
        name = available[0]
    elif name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose from {', '.join(BACKEND_NAMES)}")
    elif name not in available:
        raise ValueError(f"attention backend {name!r} is not available on {torch.device(device)}; "
                         f"available: {', '.join(available)}")
    return name


def select_backend(device, requested=None, cache_dtype: torch.dtype | None = None,
                   head_dim: int | None = None):
    """The backend object for `device`. `requested`: a backend object (returned as is), a name,
    or None (then MINIVLLM_ATTENTION_BACKEND, then the best available). An fp8 `cache_dtype`
    leaves out flash_attn, which reads a cache in the model's dtype only; a `head_dim` outside
    TRITON_HEAD_DIMS leaves out triton on a GPU (asked for by name: a ValueError)."""
    if requested is not None and not isinstance(requested, str):
        if not callable(requested):
            raise TypeError(f"backend must be a name, an attention backend or None, got "
                            f"{type(requested).__name__}")
        if cache_dtype in FP8_DTYPES and getattr(requested, "name", None) == "flash_attn":
            raise ValueError(_FP8_FLASH_ATTN)
        return requested
    name = backend_name(device, requested, cache_dtype, head_dim)
    key = (name, str(torch.device(device)))
    if key not in _logged:
        _logged.add(key)
        log.info("minivllm attention backend: %s on %s", name, key[1])
    if name == "triton" and cache_dtype in FP8_DTYPES and not runs_ptx(torch.device(device)) \
            and (name, "fp8") not in _logged:
        _logged.add((name, "fp8"))
        log.warning("minivllm: Triton's interpreter (3.7) rounds to fp8 wrongly (7.9 to 4.0): "
                    "an fp8 KV cache through the triton backend on the CPU stores other values "
                    "than on a GPU; the reference backend stores them right")
    return _make(name)
