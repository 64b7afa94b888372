"""Attention backends and the Triton kernels behind them."""

from .backends import BACKEND_NAMES, available_backends, select_backend

__all__ = ["BACKEND_NAMES", "available_backends", "select_backend"]
