"""Device memory for the KV cache: what a block takes, how many fit a budget, the budget itself
(the share of the device gpu_memory_utilization allows, less what start-up measures the largest
step, sampling and the graphs to need), and the log lines that say where the memory went
(by start-up phase; by owner: torch's allocator pools and what lies outside them). Pure
functions of their arguments, or of the device as it is now where the name says so; the runner
does the measuring (ModelRunner._cuda_kv_budget)."""

from __future__ import annotations

import os

import torch

from ..state.params import Params

GiB = 1 << 30


def kv_block_bytes(params: Params, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block across all layers (K and V) on this rank."""
    config = params.config
    per_token = 2 * config.num_layers * params.shard.num_kv_heads(config) * config.head_dim
    return per_token * block_size * torch.empty((), dtype=dtype).element_size()


# torch's CUDA caching allocator reserves a large tensor as a segment of a multiple of 2 MiB.
CUDA_SEGMENT_GRANULE = 2 << 20
# What capturing the decode graphs loads beside the allocator (graph executables, the compiled
# forward's kernels): 0.084-0.088 GiB at the 0.6B shape and at the tests' tiny one on the H200
# (session 31), set aside with the decode graphs' pool.
CAPTURE_CODE_BYTES = 128 << 20


def kv_blocks_within(budget: int, per_block: int, tensors: int, granule: int = 1) -> int:
    """The most KV blocks that fit `budget` bytes when the cache is `tensors` equal tensors (K
    and V of each layer), each block taking per_block // tensors of each, and each tensor's
    bytes are rounded up to `granule`. Unrounded, the 0.6B shape's 56 tensors went 0.08-0.10 GiB
    past the budget on the H200 (session 31)."""
    per_tensor = budget // tensors // granule * granule
    return per_tensor // (per_block // tensors)


def kv_blocks_within_caches(budget: int, caches: list[tuple[int, int]], granule: int = 1) -> int:
    """kv_blocks_within for several caches of one num_blocks (a draft model's beside the
    target's: runtime/spec_decode.py): `caches` holds (per_block, tensors) of each, per_block
    bytes a block takes across its `tensors` equal tensors. The most blocks N whose tensors,
    each rounded up to `granule` bytes, fit `budget`."""
    def need(n: int) -> int:
        return sum(tensors * -(-n * (per_block // tensors) // granule) * granule
                   for per_block, tensors in caches)
    lo, hi = 0, budget // max(1, sum(per_block for per_block, _ in caches))
    while lo < hi:  # the largest n with need(n) <= budget
        mid = (lo + hi + 1) // 2
        if need(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def cpu_kv_budget_bytes() -> int:
    """MINIVLLM_CPU_KV_CACHE_SPACE GiB when set, else 4 GiB capped at a quarter of the RAM."""
    env = os.environ.get("MINIVLLM_CPU_KV_CACHE_SPACE")
    if env:
        return int(float(env) * GiB)
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 16 * GiB
    return min(4 * GiB, ram // 4)


def device_bytes_in_use(device: torch.device) -> int:
    """Everything on the device, this process's or not (0 off CUDA)."""
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def bytes_outside_allocator(device: torch.device) -> int:
    """What the device holds beyond torch's caching allocator (CUDA only): the CUDA context,
    loaded kernels, graph executables, local memory, other processes."""
    return device_bytes_in_use(device) - torch.cuda.memory_reserved(device)


def kv_budget_bytes(total: int, utilization: float, in_use: int, forward_peak: int,
                    sampling_peak: int, decode_graphs_peak: int = 0, *,
                    graphs_hold_forward: bool) -> int:
    """What the KV cache may take: total * utilization, less what is in use and what the
    largest step needs. Without prefill graphs the forward's activations are freed before
    sampling allocates, so the larger of the two peaks is enough; with them the graphs' pool
    keeps the forward's for good, and sampling's comes on top. decode_graphs_peak: what the
    decode graphs' pool keeps for good (a decode step's peak at max_num_seqs rows; 0 without
    decode graphs)."""
    activations = forward_peak + sampling_peak if graphs_hold_forward else \
        max(forward_peak, sampling_peak)
    return int(total * utilization - in_use - activations - decode_graphs_peak)


def startup_memory_report(marks: list[tuple[str, int]], total: int,
                          utilization: float) -> tuple[str, bool]:
    """The start-up log line on device memory, and whether start-up left more in use than
    gpu_memory_utilization allows. marks: (phase, bytes in use on the device after it), in
    order, the last after start-up. What start-up builds after the KV cache (graph pools,
    compiled kernels' code, library workspaces) is estimated when the cache is sized, not
    measured; this says when the estimate fell short, and by how much."""
    limit, used = utilization * total, marks[-1][1]
    phases = ", ".join(f"{name} {bytes_ / GiB:.2f}" for name, bytes_ in marks)
    message = (f"minivllm: device memory in use after start-up: {used / GiB:.2f} GiB of "
               f"{total / GiB:.2f} (gpu_memory_utilization {utilization} allows "
               f"{limit / GiB:.2f}); GiB in use after each phase: {phases}")
    if used <= limit:
        return message, False
    return (f"{message}. That is {(used - limit) / GiB:.2f} GiB over; gpu_memory_utilization "
            f"{utilization - (used - limit) / total:.3f} would keep this engine within "
            f"{utilization} of the device"), True


def allocator_pools(segments: list[dict], device_index: int | None = None) -> dict[str, int]:
    """Bytes the caching allocator reserves, by pool, from torch.cuda.memory_snapshot()'s
    segments (those of device_index, when given; the snapshot covers every device): "default"
    and one "pool a.b" per CUDA graph pool (the graphs' pools are held for good, so their sizes
    are what the KV budget must have set aside for them)."""
    pools: dict[str, int] = {}
    for segment in segments:
        if device_index is not None and segment.get("device", device_index) != device_index:
            continue
        pool_id = tuple(segment.get("segment_pool_id") or (0, 0))
        name = "default" if pool_id == (0, 0) else "pool " + ".".join(map(str, pool_id))
        pools[name] = pools.get(name, 0) + segment["total_size"]
    return pools


def allocator_report(pools: dict[str, int], outside: int) -> str:
    """One log line: the allocator's pools (allocator_pools) and the bytes the device holds
    outside the allocator (bytes_outside_allocator)."""
    parts = ", ".join(f"{name} {bytes_ / GiB:.3f}" for name, bytes_ in pools.items())
    return (f"minivllm: device memory by owner (GiB): allocator pools {parts}; outside the "
            f"allocator {outside / GiB:.3f}")


def memory_owners(device: torch.device) -> str:
    """allocator_report for a CUDA device as it is now."""
    # memory_snapshot's first parameter is a graph pool's id, not a device: it reports every
    # device, so the device's segments are picked here.
    index = device.index if device.index is not None else torch.cuda.current_device()
    return allocator_report(allocator_pools(torch.cuda.memory_snapshot(), index),
                            bytes_outside_allocator(device))


def profile_lengths(tokens: int, max_num_seqs: int, max_model_len: int) -> list[int]:
    """The sequence lengths of the step that sizes the KV cache: `tokens` spread as evenly as
    can be over as many sequences as a step may hold, so that it asks for as many logits rows
    as the largest real step can (a prefill graph always computes max_num_seqs of them)."""
    n = min(max_num_seqs, tokens)
    if tokens > n * max_model_len:
        raise ValueError(f"{tokens} tokens do not fit {n} sequences of at most {max_model_len}")
    return [tokens // n + (i < tokens % n) for i in range(n)]
