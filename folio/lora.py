"""``LoRARequest``: which LoRA adapter a prompt runs with, in vLLM's shape.

    from folio import LLM, LoRARequest, SamplingParams
    llm = LLM(model="SmolLM2-135M-Instruct", enable_lora=True, max_loras=4, max_lora_rank=64)
    out = llm.generate(["Hello"], SamplingParams(max_tokens=8),
                       lora_request=LoRARequest("my-adapter", 1, "/path/to/peft/folder"))

The adapter is read the first time a request names it (a PEFT folder: ``adapter_config.json`` and
``adapter_model.safetensors``) and known by its name from then on; ``lora_int_id`` is kept for
vLLM's signature (names identify adapters here).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        if not self.lora_name:
            raise ValueError("a LoRARequest needs a lora_name")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be at least 1, not {self.lora_int_id}")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
