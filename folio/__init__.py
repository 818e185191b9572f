"""folio's offline API: ``from folio import LLM, SamplingParams`` (see ``folio/llm.py``)."""

import importlib
import os as _os
from pathlib import Path as _Path

# torch's OpenMP threads spin for a while after each parallel region (libgomp's default is about
# 300,000 checks): between two of torch's ops in a decode step (the LM head's top-k) they spun on
# both cores while the step's own kernels ran, 29% of the samples of a SmolLM2 decode profile, and
# a token took 8.1 ms instead of 5.8. A short spin keeps the wake-up cheap and the cores free. It
# is read when libgomp loads, with torch: an import of torch before folio keeps its own setting.
_os.environ.setdefault("GOMP_SPINCOUNT", "10000")

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
    "SamplingParams": "folio.core.frontdoor",
    "LoRARequest": "folio.lora",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'folio' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "LoRARequest"]
