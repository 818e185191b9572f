"""``from folio.sampling_params import SamplingParams``, vLLM's module path: the front door's
``SamplingParams`` (``folio/core/frontdoor.py``), the one the gateway builds too."""

from folio.core.frontdoor import SamplingParams

__all__ = ["SamplingParams"]
