"""``folio.sampling_params`` is vLLM's module path for the front door's ``SamplingParams``."""

from __future__ import annotations

import folio
from folio.core.frontdoor import SamplingParams as FrontDoor
from folio.sampling_params import SamplingParams


def test_the_module_path_gives_the_front_doors_class():
    assert SamplingParams is FrontDoor is folio.SamplingParams
    params = SamplingParams(n=2, temperature=0.5, seed=3, max_tokens=7)
    assert (params.n, params.temperature, params.seed, params.max_tokens) == (2, 0.5, 3, 7)
