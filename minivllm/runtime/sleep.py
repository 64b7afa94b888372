"""Sleep mode (vLLM's LLM.sleep / wake_up / is_sleeping): give the device's memory back between
rollouts of an RL loop (verl, TRL colocate, OpenRLHF) while a trainer uses it, and take it again
without building a new engine (no load from disk, no compile).

Level 1 copies the weights to host memory (pinned on CUDA) and discards the KV cache; level 2
discards both (the weights then come back through load_weights; until then their bytes are
zeros). wake_up(tags) takes back the memory of "weights", "kv_cache" or both; the KV cache comes
back zeroed.

How: every tensor object stays (the params and cache pytrees, the compiled functions' inputs,
the graphs' static batches), and only the memory behind it goes: each distinct storage under the
pytree is resized to 0 bytes and, on waking, back to its size (vLLM's CuMemAllocator instead
unmaps and remaps the same virtual addresses, which this engine's tensors, from the caching
allocator, cannot do). A storage grown again lives at a new address, so whatever baked the old
addresses must be rebuilt once both tags are awake (ModelRunner.wake_up): the decode and prefill
CUDA graphs, whose kernels were captured with pointers to the weights and the cache, and the
persistent decode's layer table (kernels/decode_layer.layer_table), a device tensor of those
pointers. Compiled code takes the tensors as arguments and guards on their shapes, not their
addresses: it needs nothing.

A sleep stages each pytree first (its storages, their sizes, the host copy: nothing freed), then
frees them, so that one that fails can give back exactly what it freed (ModelRunner.sleep).

A draft model (speculative decoding, runtime/spec_decode.py) sleeps with the target, as in vLLM,
whose draft is loaded into the same "weights" memory pool and whose KV cache holds the draft's
layers too: its weights go with "weights" (one pytree staged with the target's), its cache with
"kv_cache", and its decode graphs, persistent layer table and verification mirrors are captured
again with the target's. Level 2 is refused with a draft model (check_level): load_weights
refills only the target's weights, and vLLM leaves the draft's discarded ones undefined after
its reload_weights (vllm-project/vllm issue 52479, open: every draft then rejected).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_leaves, tree_map

TAGS = ("weights", "kv_cache")
LEVELS = (1, 2)


@dataclass(eq=False)
class Offloaded:
    """What offload took from a pytree: its distinct storages (emptied), each one's size in bytes
    and, if kept, a host copy of its bytes (None: discarded). freed: how many of the storages,
    in order, free has emptied or was emptying (a free that failed part-way stops short), those
    whose memory restore gives back."""

    storages: list[torch.UntypedStorage]
    nbytes: list[int]
    host: list[torch.UntypedStorage] | None
    freed: int = 0


def storages(tree) -> list[torch.UntypedStorage]:
    """The distinct non-empty storages behind tree's tensor leaves, in leaf order (a storage that
    several leaves view, as a tied weight would, once)."""
    seen, found = set(), []
    for t in tree_leaves(tree):
        if not isinstance(t, torch.Tensor):
            continue
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            found.append(s)
    return found


def owned(tree):
    """tree with every tensor leaf whose storage cannot be resized (one memory-mapped from a
    checkpoint by safetensors, on the CPU) replaced by a copy in memory of its own, so that
    offload can free it. Other leaves are kept as they are (on a GPU: all of them)."""
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) and
                    not t.untyped_storage().resizable() else t, tree)


def stage(tree, *, keep: bool) -> Offloaded:
    """What offload will free under tree, nothing freed yet: its distinct storages, their sizes
    and, when `keep`, a host copy of their bytes (pinned memory on CUDA). Waits for the device's
    queued work, which may still write them. A failure here (no host memory for the copy)
    leaves everything as it was."""
    found = storages(tree)
    sizes = [s.nbytes() for s in found]
    host = None
    if found and found[0].device.type == "cuda":
        torch.cuda.synchronize(found[0].device)
    if keep:
        pin = bool(found) and found[0].device.type == "cuda"
        host = [torch.empty(n, dtype=torch.uint8, pin_memory=pin).untyped_storage()
                for n in sizes]
        for h, s in zip(host, found):
            h.copy_(s, non_blocking=pin)
        if pin:
            torch.cuda.synchronize(found[0].device)
    return Offloaded(found, sizes, host)


def free(off: Offloaded) -> None:
    """Free the memory of each storage staged in `off` (resize_(0): the tensors stay, with no
    bytes)."""
    for i, s in enumerate(off.storages):
        off.freed = i + 1  # first: one that fails inside resize_ is given back too
        s.resize_(0)


def offload(tree, *, keep: bool) -> Offloaded:
    """Free the memory of every storage under tree, its bytes first copied to the host when
    `keep`: stage, then free."""
    off = stage(tree, keep=keep)
    free(off)
    return off


def restore(off: Offloaded) -> None:
    """Give each storage that `off`'s free emptied its size again (at a new address) and its
    bytes back: the host copy, or zeros where there is none. Those free never reached (it failed
    part-way) are left as they are; the one whose resize_(0) raised keeps its size and is not
    resized (one that cannot be, as a memory-mapped one, would raise again). A restore that
    fails can be run again."""
    back = off.storages[:off.freed]
    for s, n in zip(back, off.nbytes):
        if s.nbytes() != n:
            s.resize_(n)
    if off.host is None:
        for s in back:
            s.fill_(0)
        return
    for s, h in zip(back, off.host):
        s.copy_(h, non_blocking=True)
    if back and back[0].device.type == "cuda":
        torch.cuda.synchronize(back[0].device)  # before the host copies are freed


def check_level(level, *, draft_model: bool = False) -> int:
    """level, if it is a sleep level (1 or 2), else ValueError; ValueError for level 2 with a
    draft model (`draft_model`), whose discarded weights nothing would refill (module
    docstring)."""
    if isinstance(level, bool) or level not in LEVELS:
        raise ValueError(f"sleep level must be 1 (offload the weights to the host, discard the "
                         f"KV cache) or 2 (discard both), got {level!r}")
    if level == 2 and draft_model:
        raise ValueError("sleep(level=2) is not supported with a draft model "
                         "(speculative_config method 'draft_model'): it would discard the "
                         "draft's weights, which load_weights does not refill (it takes the "
                         "target's); sleep(level=1) offloads both to the host")
    return level


def check_tags(tags) -> tuple[str, ...]:
    """wake_up's tags as a tuple (None: every tag), ValueError for anything but a list of
    "weights" and / or "kv_cache"."""
    if tags is None:
        return TAGS
    if isinstance(tags, str) or not isinstance(tags, (list, tuple, set, frozenset)):
        raise ValueError(f"wake_up's tags are a list of {' and / or '.join(map(repr, TAGS))} "
                         f"(None: all), got {tags!r}")
    bad = [t for t in tags if t not in TAGS]
    if bad or not tags:
        raise ValueError(f"wake_up's tags are a non-empty list of "
                         f"{' and / or '.join(map(repr, TAGS))} (None: all), got {list(tags)!r}")
    return tuple(dict.fromkeys(tags))
