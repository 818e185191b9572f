"""folio's offline API: ``from folio import LLM, SamplingParams`` (see ``folio/llm.py``)."""

import importlib
from pathlib import Path as _Path

# installed, services/, shared/ and cuda/ are folio/services, folio/shared and folio/cuda
# (pyproject's package-dir); in a source checkout they sit beside this folder: this makes them
# folio.services, folio.shared and folio.cuda there even where the editable install predates
# that mapping
_CHECKOUT = _Path(__file__).resolve().parent.parent
if (_CHECKOUT / "services" / "serve.py").exists() and not (_Path(__file__).parent / "services").exists():
    __path__.append(str(_CHECKOUT))

# what ``from folio import NAME`` loads, only when asked: importing folio.services or
# folio.shared imports this package first, and a service must not load the engine for it
_EXPORTS = {
    "LLM": "folio.llm",
    "CompletionOutput": "folio.outputs",
    "Logprob": "folio.outputs",
    "RequestOutput": "folio.outputs",
    "SamplingParams": "folio.shared.sampling",
    "LoRARequest": "folio.lora",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'folio' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "LoRARequest"]
