"""The Llama family (Llama 2/3, Mistral, Qwen2/2.5, SmolLM2): the shared layers as they are.

``registry.py`` picks it for ``model_type`` llama, mistral or qwen2 (Qwen2 adds q/k/v biases,
which ``ModelSpec.from_hf_config`` reads). Mistral's ``sliding_window`` is not applied: a prompt
longer than the window diverges from the reference.
"""

from __future__ import annotations

from folio.core.executor.model.layers import CausalLM


class LlamaForCausalLM(CausalLM):
    """Embeddings -> [RMSNorm -> attention -> RMSNorm -> SwiGLU MLP] x L -> RMSNorm -> LM head."""

    model_types = ("llama", "mistral", "qwen2")
    architectures = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
