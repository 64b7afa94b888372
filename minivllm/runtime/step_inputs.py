"""A CUDA graph's per-step inputs: Batch fields at a static shape, packed into one device buffer so
that a step's host data goes over in one copy (five copies and their launch gaps cost ~5 us of
the single stream's ~800 us step), filled from two pinned host stagings used in turn (with
asynchronous scheduling the host fills step N+1 while step N's copy may still be queued; an
event per staging says when its copy is done). The decode graphs (runtime/graphs.py) and the
prefill graphs (runtime/prefill_graph.py) keep theirs here."""

from __future__ import annotations

import numpy as np
import torch

ALIGN = 16  # bytes: each field starts aligned (Triton and Inductor specialise on it)


def batch_layout(num_tokens: int, num_seqs: int, max_blocks: int, *, lora: bool = False,
                 num_logits: int | None = None) -> dict[str, tuple]:
    """Batch's fields at a static shape, in Batch's order: name -> (dtype, shape). lora: with
    Batch.lora_slots (each token's LoRA slot). num_logits: logits rows (num_seqs if None)."""
    t, s = num_tokens, num_seqs
    layout = dict(input_ids=(torch.int64, (t,)), positions=(torch.int64, (t,)),
                  slot_mapping=(torch.int64, (t,)), cu_seqlens_q=(torch.int32, (s + 1,)),
                  context_lens=(torch.int32, (s,)), block_tables=(torch.int32, (s, max_blocks)),
                  logits_indices=(torch.int64, (s if num_logits is None else num_logits,)))
    if lora:
        layout["lora_slots"] = (torch.int64, (t,))
    return layout


def packed_offsets(layout: dict[str, tuple]) -> tuple[dict[str, int], int]:
    """Each field's byte offset, one after another, each aligned; and the bytes of them all."""
    offsets, at = {}, 0
    for name, (dtype, shape) in layout.items():
        offsets[name] = at
        size = int(np.prod(shape)) * dtype.itemsize
        at += size + -size % ALIGN
    return offsets, at


def packed_views(buffer: torch.Tensor, layout: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """Each field of `layout` as a view of the uint8 `buffer` at its packed offset."""
    offsets, _ = packed_offsets(layout)
    return {name: buffer[at: at + int(np.prod(shape)) * dtype.itemsize].view(dtype).view(shape)
            for (name, (dtype, shape)), at in zip(layout.items(), offsets.values())}


class StepInputs:
    """views: the fields on the device (what the graph reads). next_host() hands the other
    staging's fields as numpy arrays, once its last copy is done; send(start, end) copies bytes
    [start, end) of it to the device buffer (non-blocking, then an event)."""

    def __init__(self, layout: dict[str, tuple], device: torch.device):
        self.device = device
        self.offsets, size = packed_offsets(layout)
        self.packed = torch.zeros(size, dtype=torch.uint8, device=device)
        self.views = packed_views(self.packed, layout)
        pin = device.type == "cuda"
        self.staging = [torch.zeros(size, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        # The fields as numpy arrays, made once: a step's fill is then numpy work only.
        self.host_fields = [{k: v.numpy() for k, v in packed_views(host, layout).items()}
                            for host in self.staging]
        self.staged = [None, None]  # the event after each staging's copy
        self.turn = 0

    def next_host(self) -> dict[str, np.ndarray]:
        self.turn ^= 1
        if self.staged[self.turn] is not None:
            self.staged[self.turn].synchronize()
        return self.host_fields[self.turn]

    def send(self, start: int = 0, end: int | None = None) -> None:
        self.packed[start:end].copy_(self.staging[self.turn][start:end], non_blocking=True)
        if self.device.type == "cuda":
            self.staged[self.turn] = torch.cuda.Event()
            self.staged[self.turn].record()
