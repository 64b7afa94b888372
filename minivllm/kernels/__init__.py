"""Attention backends and the Triton kernels behind them."""

from .backends import available_backends, select_backend

__all__ = ["available_backends", "select_backend"]
