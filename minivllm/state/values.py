"""Reading the numbers and flags users pass, for every layer's input checks: an integer may be a
numpy or torch integer scalar (ids and counts often come out of arrays), a bool is never a
number, and a string is never a bool (bool("false") is True)."""

from __future__ import annotations

import math
import numbers
import operator

import torch


def as_int(x) -> int | None:
    """x as a Python int when it is an integer (an int, or a numpy / torch integer scalar), else
    None: bools and bool tensors included, whose True would pass as 1, and one-element tensors
    of higher rank, which torch would index as their element."""
    if isinstance(x, bool) or (isinstance(x, torch.Tensor) and (x.dtype == torch.bool or x.ndim)):
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def as_real(x) -> float | None:
    """x as a finite Python float when it is a real number (int, float, numpy scalar), else None:
    bools, NaN, infinities and ints too large for a float included."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        return None
    try:
        f = float(x)
    except (OverflowError, TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def as_flag(name: str, value, default: bool) -> bool:
    """An on/off option: True or False, or None for its default (vLLM's optional flags)."""
    if value is None:
        return default
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False (or None for the default, {default}), "
                        f"got {value!r}")
    return value
