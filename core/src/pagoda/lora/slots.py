"""Where adapters live on a worker: up to ``lora.max_cpu_loras`` read into host memory and
``lora.max_loras`` written into the device slots of every wrapped layer, each an LRU.

``activate`` makes a step's adapters resident and returns their slots; the scheduler never runs
more distinct adapters in a step than there are slots, so the adapters it evicts are never the
step's own. A slot is overwritten on the stream the steps run on: a step launched before reads
the old weights, every later one the new.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from pagoda.lora.layers import LoRALinear
from pagoda.lora.peft import AdapterWeights, load_adapter
from pagoda.lora_request import LoRARequest


class AdapterSlots:
    def __init__(
        self,
        layers: list[LoRALinear],
        model_config: Any,
        num_slots: int,
        max_rank: int,
        cpu_capacity: int,
    ) -> None:
        self.layers = layers
        self.model_config = model_config
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.cpu_capacity = max(cpu_capacity, num_slots)
        self.host: OrderedDict[int, AdapterWeights] = OrderedDict()  # lora id -> weights
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # lora id -> device slot
        self.loads = 0  # adapters written into a slot since start (a test reads it)
        self.version = 0  # changes whenever an adapter's slot does (the runner's inputs cache)
        # The last ``activate``'s adapters that could not be read (lora id -> why): they got no
        # slot, and their requests fail alone.
        self.failures: dict[int, str] = {}

    def _host_copy(self, lora: LoRARequest) -> AdapterWeights:
        held = self.host.get(lora.lora_int_id)
        if held is not None and held.lora.lora_path == lora.lora_path:
            self.host.move_to_end(lora.lora_int_id)
            return held
        weights = load_adapter(lora, self.model_config, self.max_rank)
        self.host[lora.lora_int_id] = weights
        while len(self.host) > self.cpu_capacity:
            self.host.popitem(last=False)
        return weights

    def activate(self, loras: dict[int, LoRARequest]) -> dict[int, int]:
        """Make every adapter of ``loras`` (by id) resident; their slots by id. An adapter that
        cannot be read gets none: it is in ``failures``."""
        if len(loras) > self.num_slots:
            raise RuntimeError(
                f"a step with {len(loras)} adapters and {self.num_slots} slots (lora.max_loras):"
                " the scheduler should have held some back"
            )
        for lid in loras:
            if lid in self.slot_of:
                self.slot_of.move_to_end(lid)
        self.failures = {}
        for lid, lora in loras.items():
            if lid in self.slot_of:
                continue
            try:
                weights = self._host_copy(lora)
            except (OSError, ValueError, KeyError, RuntimeError) as e:
                # NOTE: checked when the request came in, its files can still change or vanish
                # before its first step here: its requests fail, the step goes on.
                self.failures[lid] = (
                    f"LoRA adapter {lora.lora_name!r} ({lora.lora_path}) could not be loaded: {e}"
                )
                continue
            used = set(self.slot_of.values())
            free = [s for s in range(self.num_slots) if s not in used]
            if free:
                slot = free[0]
            else:  # the least recently used adapter that this step does not run
                victim = next(v for v in self.slot_of if v not in loras)
                slot = self.slot_of.pop(victim)
            for layer in self.layers:
                layer.set_slot(slot, weights)
            self.slot_of[lid] = slot
            self.loads += 1
            self.version += 1
        return {lid: self.slot_of[lid] for lid in loras if lid not in self.failures}

    def remove(self, lora_id: int) -> None:
        """Forget adapter ``lora_id`` (unloaded): its slot and host copy are free."""
        self.host.pop(lora_id, None)
        self.slot_of.pop(lora_id, None)
        self.version += 1
