"""Adapters in host memory and in the device's slots, and the projections that add their delta.

``LoRAManager`` registers adapters by name (``add``: read and checked at once, so a bad folder
fails there and nothing changes), keeps up to ``max_cpu_loras`` of them read in host memory (least
recently used dropped first, read again from their folder when needed), and ``max_loras`` on the
device in preallocated slots: per layer and projection, ``a`` ``[max_loras, parts * max_lora_rank,
in]`` and ``b`` ``[max_loras, out, parts * max_lora_rank]`` (a fused projection's parts stacked
along the rank: q/k/v in ``qkv_proj``, gate/up in ``gate_up_proj``), on the CPU also ``b``
transposed (``slot_b_t``, for punica's one-GEMM path), in the runner's activation dtype. ``activate`` puts a step's
adapters into slots (the least recently used slot not needed by the step is evicted) and gives
their slot numbers; copying an adapter in is a few device copies, done as the step starts.

``attach`` wraps the model's ``qkv_proj``, ``o_proj``, ``gate_up_proj`` and ``down_proj`` in
``LoRAProjection``: the base layer's output (dense, oneDNN-packed or quantized alike) plus the
step's batched delta (``punica.LoRABatch``), when the step has one.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from folio.core.executor.lora.adapters import PARENT, PROJECTIONS, LoRAAdapter, LoRAError, load_peft_adapter, \
    projection_layout
from folio.core.executor.lora.punica import LoRABatch


class LoRAProjection(nn.Module):
    """A projection's output plus the current step's LoRA delta for its rows."""

    def __init__(self, base: nn.Module, manager: "LoRAManager", layer: int, projection: str):
        super().__init__()
        self.base = base
        self.layer, self.projection = layer, projection
        self._manager = [manager]  # not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        manager = self._manager[0]
        step = manager.step
        if step is not None:
            key = (self.layer, self.projection)
            a, b = manager.slot_weights[key]
            step.apply(y, x, a, b, self.projection, manager.slot_b_t.get(key))
        return y


class LoRAManager:
    def __init__(self, model, max_loras: int = 4, max_lora_rank: int = 16, max_cpu_loras: int | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, not {max_loras}")
        if max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, not {max_lora_rank}")
        self.model = model
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.max_cpu_loras = max(max_loras, max_cpu_loras if max_cpu_loras is not None else max_loras)
        self.device, self.dtype = torch.device(device), dtype
        self.layout = projection_layout(model)
        self.slot_weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.slot_b_t: dict[tuple[int, str], torch.Tensor] = {}  # B transposed, [slots, width, out] (CPU)
        for i, projections in enumerate(self.layout):
            for name, proj in projections.items():
                width = len(proj.parts) * max_lora_rank
                self.slot_weights[(i, name)] = (
                    torch.zeros(max_loras, width, proj.in_features, device=self.device, dtype=dtype),
                    torch.zeros(max_loras, proj.out_features, width, device=self.device, dtype=dtype))
                if self.device.type == "cpu":
                    self.slot_b_t[(i, name)] = torch.zeros(max_loras, width, proj.out_features, dtype=dtype)
        self.scales = torch.zeros(max_loras, dtype=torch.float32)
        self.widths: dict[str, list[int]] = {p: [0] * max_loras for p in PROJECTIONS}
        self.paths: dict[str, str] = {}  # every registered adapter
        self.ids: dict[str, int] = {}  # name -> a small integer id (1, 2, ...; 0 is the base model)
        self.name_of_id: dict[int, str] = {}
        self._next_id = 1
        self.host: OrderedDict[str, LoRAAdapter] = OrderedDict()  # read adapters, least recently used first
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # adapters in slots, least recently used first
        self.free_slots = list(range(max_loras))
        self.loads = 0  # adapters copied into a device slot
        self.evictions = 0  # adapters evicted from a device slot to make room
        self.host_loads = 0  # adapters read from their folder
        self.host_evictions = 0
        self.step: LoRABatch | None = None

    # ------------------------------------------------------------------ registry
    def add(self, name: str, path: str) -> LoRAAdapter:
        """Read and check the adapter at ``path`` and register it as ``name`` (replacing one of
        that name); raises ``LoRAError`` and changes nothing when it cannot be served."""
        if not name:
            raise LoRAError("a LoRA adapter needs a name")
        adapter = load_peft_adapter(path, self.model, self.max_lora_rank, name)
        self.host_loads += 1
        if name in self.paths:
            self._unload(name)
        else:
            self.ids[name] = self._next_id
            self.name_of_id[self._next_id] = name
            self._next_id += 1
        self.paths[name] = str(path)
        self._keep_on_host(adapter)
        return adapter

    def remove(self, name: str) -> None:
        if name not in self.paths:
            raise LoRAError(f"no LoRA adapter named {name!r}")
        self._unload(name)
        del self.paths[name]
        self.name_of_id.pop(self.ids.pop(name))

    def names(self) -> list[str]:
        return list(self.paths)

    def id_of(self, name: str) -> int:
        try:
            return self.ids[name]
        except KeyError:
            raise LoRAError(f"no LoRA adapter named {name!r}") from None

    def _unload(self, name: str) -> None:
        self.host.pop(name, None)
        slot = self.slot_of.pop(name, None)
        if slot is not None:
            self._clear_slot(slot)
            self.free_slots.append(slot)

    def _keep_on_host(self, adapter: LoRAAdapter) -> None:
        self.host[adapter.name] = adapter
        self.host.move_to_end(adapter.name)
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
            self.host_evictions += 1

    def _host_adapter(self, name: str) -> LoRAAdapter:
        adapter = self.host.get(name)
        if adapter is None:  # dropped from host memory: read again
            adapter = load_peft_adapter(self.paths[name], self.model, self.max_lora_rank, name)
            self.host_loads += 1
        self._keep_on_host(adapter)
        return adapter

    # ------------------------------------------------------------------ device slots
    def activate(self, names) -> dict[str, int]:
        """Each of ``names`` (distinct adapters of one step) in a device slot: name -> slot.
        Raises ``LoRAError`` for an unknown name or more adapters than slots."""
        wanted = list(dict.fromkeys(names))
        if len(wanted) > self.max_loras:
            raise LoRAError(f"{len(wanted)} adapters in one step, more than max_loras {self.max_loras}")
        for name in wanted:
            if name not in self.paths:
                raise LoRAError(f"no LoRA adapter named {name!r}")
        for name in wanted:
            if name in self.slot_of:
                self.slot_of.move_to_end(name)
                continue
            if not self.free_slots:
                victim = next(n for n in self.slot_of if n not in wanted)
                self.free_slots.append(self.slot_of.pop(victim))
                self.evictions += 1
            slot = min(self.free_slots)  # the lowest: a step's slots stay a short prefix (punica's dense path)
            self.free_slots.remove(slot)
            self._load_slot(slot, self._host_adapter(name))
            self.slot_of[name] = slot
            self.loads += 1
        return {name: self.slot_of[name] for name in wanted}

    def _clear_slot(self, slot: int) -> None:
        for a, b in self.slot_weights.values():
            a[slot].zero_()
            b[slot].zero_()
        for b_t in self.slot_b_t.values():
            b_t[slot].zero_()
        self.scales[slot] = 0.0
        for widths in self.widths.values():
            widths[slot] = 0

    def _load_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        """The adapter's parts packed along the rank from column 0 (so that the used width is a
        prefix); the rest of the slot zeros."""
        self._clear_slot(slot)
        for (layer, projection), parts in adapter.modules.items():
            a_slot, b_slot = self.slot_weights[(layer, projection)]
            proj = self.layout[layer][projection]
            col = 0
            for part, (a, b) in sorted(parts.items()):
                row0, rows = proj.parts[part]
                r = a.shape[0]
                a_slot[slot, col : col + r].copy_(a)
                b_slot[slot, row0 : row0 + rows, col : col + r].copy_(b)
                if self.slot_b_t:
                    self.slot_b_t[(layer, projection)][slot, col : col + r, row0 : row0 + rows].copy_(b.T)
                col += r
            self.widths[projection][slot] = max(self.widths[projection][slot], col)
        self.scales[slot] = adapter.scaling

    def set_step(self, step: LoRABatch | None) -> None:
        self.step = step

    def attach(self, model=None) -> int:
        """Wrap every projection an adapter may target; returns how many were wrapped."""
        model = model or self.model
        count = 0
        for i, projections in enumerate(self.layout):
            layer = model.layers[i]
            for name in projections:
                parent = getattr(layer, PARENT[name])
                base = getattr(parent, name)
                if not isinstance(base, LoRAProjection):
                    setattr(parent, name, LoRAProjection(base, self, i, name))
                    count += 1
        return count

    def stats(self) -> dict:
        return {"lora_adapters": self.names(), "lora_active": list(self.slot_of), "lora_loads": self.loads,
                "lora_evictions": self.evictions, "lora_host_loads": self.host_loads,
                "lora_host_evictions": self.host_evictions}
