"""LoRA requests and the engine's adapter slots (vLLM's LoRARequest and LRU slot cache).

The runner holds max_loras adapters at once (state/lora.py's stacked slot weights). Before a
step, the engine asks LoRASlots for a slot for every adapter the step's rows use: one already
there, else a free slot, else the least recently used slot whose adapter no running sequence
uses (the scheduler admits a sequence only while the running sequences use at most max_loras
adapters, so there always is one). The slot is then written with the adapter's weights.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for a request, as vLLM's: `lora_name` names it, `lora_int_id` (>= 1)
    identifies it (two requests with one id use one adapter, loaded once; the prefix cache is
    kept apart per id), `lora_path` is a PEFT LoRA directory (adapter_config.json,
    adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or \
                self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        path = os.fspath(self.lora_path) if isinstance(self.lora_path, (str, os.PathLike)) \
            else None
        if not isinstance(path, str):
            raise TypeError(f"lora_path must be a string or a path (a PEFT adapter directory), "
                            f"got {self.lora_path!r}")
        object.__setattr__(self, "lora_path", path)

    # vLLM's aliases
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


class LoRASlots:
    """Which adapter (by lora_int_id) each of max_loras slots holds, least recently used
    first."""

    def __init__(self, max_loras: int):
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.max_loras = max_loras
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first

    def assign(self, needed: Iterable[int], in_use: Iterable[int] = ()
               ) -> tuple[dict[int, int], list[tuple[int, int]]]:
        """Slots for the adapters `needed` by a step, never evicting one of them or of `in_use`
        (the running sequences' adapters). Returns (adapter id -> slot for each needed one,
        [(slot, adapter id)] the slots to (re)write). RuntimeError if more adapters are needed
        at once than there are slots, or every slot is held by an adapter in use."""
        needed = list(dict.fromkeys(needed))
        if len(needed) > self.max_loras:
            raise RuntimeError(f"a step uses {len(needed)} LoRA adapters, more than "
                               f"max_loras={self.max_loras}")
        keep = set(needed) | set(in_use)
        loads = []
        for lid in needed:
            if lid in self.slot_of:
                self.slot_of.move_to_end(lid)
                continue
            taken = set(self.slot_of.values())
            free = [s for s in range(self.max_loras) if s not in taken]
            if free:
                slot = free[0]
            else:
                victim = next((v for v in self.slot_of if v not in keep), None)
                if victim is None:
                    raise RuntimeError(f"every LoRA slot holds an adapter in use "
                                       f"(max_loras={self.max_loras})")
                slot = self.slot_of.pop(victim)
            self.slot_of[lid] = slot
            loads.append((slot, lid))
        return {lid: self.slot_of[lid] for lid in needed}, loads

    def forget(self, lid: int) -> None:
        """Drop adapter lid's slot (a failed load, whose weights were not all written; an
        unloaded adapter no sequence uses): free for the next, which is written whole."""
        self.slot_of.pop(lid, None)
