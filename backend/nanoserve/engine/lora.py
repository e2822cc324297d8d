"""LoRA adapters on the engine's side: what a request's lora_name names, and which adapter each of the max_loras
device slots holds (docs/architecture.md, "Multi-LoRA"). A slot no running sequence uses keeps its adapter until
another adapter needs it (least recently used first); a refill travels in the SchedulerOutput's `lora_loads`."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import xxhash


@dataclass(frozen=True)
class LoRAAdapter:
    id: int  # unique in the engine, never reused: it keys the runners' CPU copies and the prefix cache
    name: str
    path: str  # the PEFT adapter directory

    @property
    def cache_key(self) -> int:
        """Where this adapter's prefix-cache hash chains start (a base sequence's start at NO_HASH)."""
        return xxhash.xxh64_intdigest(b"lora" + self.id.to_bytes(8, "little"))


class LoRASlots:
    def __init__(self, num_slots: int):
        self.adapters: list[LoRAAdapter | None] = [None] * num_slots  # what each slot holds
        self.num_users = [0] * num_slots  # running sequences per slot
        self.idle: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_slots))  # unused, least recently first

    def slot_of(self, adapter: LoRAAdapter) -> int | None:
        return self.adapters.index(adapter) if adapter in self.adapters else None

    def can_acquire(self, adapter: LoRAAdapter) -> bool:
        return bool(self.idle) or adapter in self.adapters

    def acquire(self, adapter: LoRAAdapter) -> tuple[int, bool]:
        """A slot for one more sequence of adapter: the one that holds it, else the least recently used idle one;
        and whether the adapter must be loaded into it."""
        slot = self.slot_of(adapter)
        load = slot is None
        if load:
            slot = next(iter(self.idle))
            self.adapters[slot] = adapter
        self.num_users[slot] += 1
        self.idle.pop(slot, None)
        return slot, load

    def release(self, adapter: LoRAAdapter) -> None:
        """A sequence of adapter left the running batch."""
        slot = self.slot_of(adapter)
        self.num_users[slot] -= 1
        if not self.num_users[slot]:
            self.idle[slot] = None

    def forget(self) -> None:
        """Treat every slot as empty (after a failed step, when no sequence runs): adapters are loaded again."""
        assert not any(self.num_users), "forget() with running sequences"
        self.adapters = [None] * len(self.adapters)
