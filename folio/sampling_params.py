"""``from folio.sampling_params import SamplingParams``, vLLM's module path: the one sampling
struct (``shared/sampling.py``), the one the gateway builds too."""

from folio.shared.sampling import SamplingParams

__all__ = ["SamplingParams"]
