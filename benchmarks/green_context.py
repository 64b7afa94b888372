"""Two disjoint SM partitions of a GPU as CUDA green contexts, with torch streams on each.

    gemm_streams, attention_streams = sm_partition_streams(device_sms=16, streams_each=2)

Work launched on a stream of one partition runs only on that partition's SMs, so one kind of
kernel (the GEMMs) can keep SMs that another (decode attention, which would otherwise fill every
SM) never takes. torch 2.11's GreenContext makes one partition of a given size but not its
complement, so the driver API is called directly (CUDA 12.4+): the device's SM resource is
split into a group of `device_sms` SMs and the remainder, and each becomes a green context.
CUdevResource is passed to the driver as an opaque buffer (its size changed between CUDA
releases); nothing here reads its fields.
"""

from __future__ import annotations

import ctypes

import torch

_RESOURCE_BYTES = 1024  # larger than any CUDA release's CUdevResource
_SM_RESOURCE = 1  # CU_DEV_RESOURCE_TYPE_SM
_GREEN_CTX_DEFAULT_STREAM = 1
_STREAM_NON_BLOCKING = 1


def _driver():
    lib = ctypes.CDLL("libcuda.so.1")

    def call(name, *args):
        rc = getattr(lib, name)(*args)
        if rc != 0:
            raise RuntimeError(f"{name} failed with CUresult {rc}")
    return call


def _green_context(call, resource, device: int):
    desc = ctypes.c_void_p()
    call("cuDevResourceGenerateDesc", ctypes.byref(desc), resource, ctypes.c_uint(1))
    ctx = ctypes.c_void_p()
    call("cuGreenCtxCreate", ctypes.byref(ctx), desc, ctypes.c_int(device),
         ctypes.c_uint(_GREEN_CTX_DEFAULT_STREAM))
    return ctx


def _streams(call, ctx, count: int, device: torch.device) -> list[torch.cuda.ExternalStream]:
    out = []
    for _ in range(count):
        handle = ctypes.c_void_p()
        call("cuGreenCtxStreamCreate", ctypes.byref(handle), ctx,
             ctypes.c_uint(_STREAM_NON_BLOCKING), ctypes.c_int(0))
        out.append(torch.cuda.ExternalStream(handle.value, device=device))
    return out


def sm_partition_streams(device_sms: int, streams_each: int = 1, device: int = 0):
    """(streams on a partition of `device_sms` SMs, streams on the remaining SMs), each list
    `streams_each` long. The contexts and streams live as long as the process (never freed)."""
    torch.cuda.init()
    torch.cuda.synchronize(device)  # the primary context current and initialised
    call = _driver()
    whole = ctypes.create_string_buffer(_RESOURCE_BYTES)
    call("cuDeviceGetDevResource", ctypes.c_int(device), whole, ctypes.c_int(_SM_RESOURCE))
    group = ctypes.create_string_buffer(_RESOURCE_BYTES)
    rest = ctypes.create_string_buffer(_RESOURCE_BYTES)
    groups = ctypes.c_uint(1)
    call("cuDevSmResourceSplitByCount", group, ctypes.byref(groups), whole, rest,
         ctypes.c_uint(0), ctypes.c_uint(device_sms))
    if groups.value != 1:
        raise RuntimeError(f"could not split off one group of {device_sms} SMs")
    dev = torch.device("cuda", device)
    return (_streams(call, _green_context(call, group, device), streams_each, dev),
            _streams(call, _green_context(call, rest, device), streams_each, dev))


def sm_count_probe(stream, device: torch.device) -> float:
    """Milliseconds a fixed spin workload of many blocks takes on `stream`: proportional to
    1 / (SMs the stream may use), which checks that a partition took effect."""
    x = torch.ones(1 << 26, device=device)
    with torch.cuda.stream(stream):
        for _ in range(3):
            x.mul_(1.0000001)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(stream)
        for _ in range(20):
            x.mul_(1.0000001)
        e1.record(stream)
    e1.synchronize()
    return e0.elapsed_time(e1) / 20
