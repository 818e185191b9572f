"""Which family runs a checkpoint: its config's ``architectures`` first, then its ``model_type``.

``loader.load_model``, ``sharded_load.py`` and the tensor-parallel workers' start-up
check call it; an unsupported model fails there, before any weight is read, with the list of
what runs. ``check_runtime`` refuses, also at start, what a family cannot do yet (mixture of
experts: CUDA, quantization other than int8/int4).
"""

from __future__ import annotations

from folio.core.executor.model.bert import BertModel
from folio.core.executor.model.gemma2 import Gemma2ForCausalLM
from folio.core.executor.model.gemma3 import Gemma3ForCausalLM
from folio.core.executor.model.gemma3_vlm import Gemma3ForConditionalGeneration
from folio.core.executor.model.idefics3 import Idefics3ForConditionalGeneration
from folio.core.executor.model.layers import CausalLM, ModelSpec
from folio.core.executor.model.llama import LlamaForCausalLM
from folio.core.executor.model.llava import LlavaForConditionalGeneration
from folio.core.executor.model.mixtral import MixtralForCausalLM
from folio.core.executor.model.olmoe import OlmoeForCausalLM
from folio.core.executor.model.phi3 import Phi3ForCausalLM
from folio.core.executor.model.qwen2_5_vl import Qwen25VLForConditionalGeneration
from folio.core.executor.model.qwen2_moe import Qwen2MoeForCausalLM
from folio.core.executor.model.qwen3 import Qwen3ForCausalLM
from folio.core.executor.model.qwen3_moe import Qwen3MoeForCausalLM
from folio.core.executor.parallel.comm import Comm, Shard

FAMILIES: tuple[type[CausalLM], ...] = (
    LlamaForCausalLM, Qwen3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, Phi3ForCausalLM,
    MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, OlmoeForCausalLM, LlavaForConditionalGeneration,
    Idefics3ForConditionalGeneration, Qwen25VLForConditionalGeneration, Gemma3ForConditionalGeneration, BertModel,
)
# images in: a tower in the executor
VISION_MODEL_TYPES = LlavaForConditionalGeneration.model_types + Idefics3ForConditionalGeneration.model_types \
    + Qwen25VLForConditionalGeneration.model_types + Gemma3ForConditionalGeneration.model_types
# checkpoints refused with a reason of their own
REFUSED: dict[str, str] = {}


def supported() -> str:
    """``model_type (Architecture), ...`` of every family, for error messages."""
    return ", ".join(f"{t} ({a})" for f in FAMILIES for t, a in zip(f.model_types, f.architectures))


def family_for(config) -> type[CausalLM]:
    for arch in getattr(config, "architectures", None) or ():
        if arch in REFUSED:
            raise ValueError(f"unsupported architecture {arch}: {REFUSED[arch]}; folio runs {supported()}")
        for family in FAMILIES:
            if arch in family.architectures:
                return family
    model_type = getattr(config, "model_type", None)
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    archs = ", ".join(getattr(config, "architectures", None) or ()) or "none given"
    raise ValueError(f"unsupported model_type {model_type!r} (architectures: {archs}); folio runs {supported()}")


def model_spec(config) -> ModelSpec:
    """The checked spec of a checkpoint's config (raises for an unsupported model)."""
    return family_for(config).spec_from_config(config)


def build_model(spec: ModelSpec, config, shard: Shard = Shard(), comm: Comm | None = None) -> CausalLM:
    """The family's modules at ``spec``'s sizes (weights uninitialised: build under the meta device)."""
    return family_for(config)(spec, config, shard, comm)


def check_runtime(spec: ModelSpec, *, device: str = "cpu", quantization: str = "none", tp_size: int = 1) -> None:
    """A clear error at start for what the model's family does not run yet."""
    if spec.model_type in BertModel.model_types:  # encoder-only: the torch path on the CPU, dense
        if device != "cpu" or tp_size > 1 or quantization not in ("none", "auto"):
            raise ValueError(f"encoder-only models ({spec.model_type}) run on one CPU, unquantized, in this build: "
                             f"use --device cpu and --quantization none (not {device}, {quantization}, "
                             f"tensor_parallel_size {tp_size})")
    if spec.model_type in VISION_MODEL_TYPES and tp_size > 1:
        raise ValueError("vision-language models run on one device only in this build (no tensor parallelism)")
    if not spec.num_experts:
        return
    what = f"mixture-of-experts models ({spec.model_type})"
    if quantization not in ("none", "auto", "int8", "int4"):
        raise ValueError(f"{what} run quantized as int8 or int4 only, not {quantization}")
    if device != "cpu":
        raise ValueError(f"{what} run on the CPU only in this build, not on {device}: use --device cpu")
