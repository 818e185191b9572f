"""The Llama family (Llama 2/3, Mistral, Qwen2/2.5, SmolLM2): the shared layers as they are.

``registry.py`` picks it for ``model_type`` llama, mistral or qwen2 (Qwen2 adds q/k/v biases,
which ``ModelSpec.from_hf_config`` reads). Sliding windows are the config's, as transformers
applies them (``layers.layer_windows``): Mistral's ``sliding_window`` on every layer, Qwen2's
with ``use_sliding_window`` on the layers from ``max_window_layers`` on.
"""

from __future__ import annotations

from folio.core.executor.model.layers import CausalLM


class LlamaForCausalLM(CausalLM):
    """Embeddings -> [RMSNorm -> attention -> RMSNorm -> SwiGLU MLP] x L -> RMSNorm -> LM head."""

    model_types = ("llama", "mistral", "qwen2")
    architectures = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
