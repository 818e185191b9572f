"""PEFT adapters for the tests and ``scripts/bench_lora.py``: written by ``peft`` itself (a test
extra), on any base model folder, with non-zero A and B so that every adapter changes the output."""

from __future__ import annotations

from pathlib import Path


def write_peft_adapter(base: str | Path, out_dir: str | Path, rank: int, targets: list[str], *,
                       alpha: float | None = None, rslora: bool = False, seed: int | None = 0,
                       std: float | None = 0.3) -> str:
    """An adapter of ``base`` in ``out_dir`` (``adapter_config.json`` + ``adapter_model.safetensors``).

    ``alpha`` defaults to 2 x rank. A and B come from peft's own random init (``init_lora_weights=False``)
    after ``torch.manual_seed(seed)`` (``seed`` None: the generator as it is), then, unless ``std`` is
    None, are redrawn from N(0, std), large enough that the adapter changes greedy tokens.
    """
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank if alpha is None else alpha, target_modules=targets,
                             use_rslora=rslora, init_lora_weights=False, lora_dropout=0.0)
    if seed is not None:
        torch.manual_seed(seed)
    model = peft.get_peft_model(model, config)
    if std is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_(0.0, std)
    model.save_pretrained(str(out_dir))
    return str(out_dir)
