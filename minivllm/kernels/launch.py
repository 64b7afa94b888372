"""What the kernels' launch choices depend on: the device, read off tensors, never off data.

Every grid and tile size here derives from shapes and the device, so a backend call traces under
torch.compile and replays under CUDA graphs without a host sync (no .item())."""

from __future__ import annotations

import functools
import os

import torch


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1: kernels run on the CPU through Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def runs_ptx(device: torch.device) -> bool:
    """Kernels on `device` compile to the GPU's code (PTX): a CUDA device, not the interpreter.
    What only the GPU runs (inline PTX, tile configs tuned on it) is chosen by this."""
    return device.type == "cuda" and not interpreting()


def triton_usable(device) -> bool:
    """Triton kernels can run on tensors of `device`: CUDA, or any device under the interpreter."""
    device = torch.device(device)
    return device.type == "cuda" or (interpreting() and device.type == "cpu")


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of a CUDA device; (0, 0) for any other, the interpreter's included."""
    if not runs_ptx(device):
        return (0, 0)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.compiler.is_compiling():  # as num_sms, below
        return torch.cuda.get_device_capability(index)
    return _cuda_capability(index)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors to fill; under the interpreter a small number, so that tests on
    tiny shapes still take the split-KV paths."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.compiler.is_compiling():
        # Dynamo traces the property read to a constant, as it did through the lru_cache
        # wrapper, which it ignores with a UserWarning at every engine start.
        return torch.cuda.get_device_properties(index).multi_processor_count
    return _cuda_sms(index)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 operands keep fp32 products (tf32 would cost ~3e-4 relative error); 16-bit ones use
    the tensor cores' native products, where the setting has no effect."""
    return "ieee" if dtype == torch.float32 else "tf32"


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def dot_block(n: int) -> int:
    """A block that spans a dimension of tl.dot: a power of two, at least the 16 a GPU's MMA
    takes (the interpreter takes less; tests/test_zz_kernels_compile.py checks the compiler)."""
    return max(16, next_pow2(n))
