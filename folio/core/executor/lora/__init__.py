"""Multi-LoRA serving: PEFT adapters (``adapters``), their host cache and device slots
(``manager``) and the batched delta every projection adds (``punica``)."""

from folio.core.executor.lora.adapters import LoRAAdapter, LoRAError, load_peft_adapter
from folio.core.executor.lora.manager import LoRAManager, LoRAProjection
from folio.core.executor.lora.punica import LoRABatch, bgmv, sgmv

__all__ = ["LoRAAdapter", "LoRAError", "LoRABatch", "LoRAManager", "LoRAProjection", "bgmv", "load_peft_adapter",
           "sgmv"]
