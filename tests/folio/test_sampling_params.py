"""``folio.sampling_params`` is vLLM's module path for the one sampling struct."""

from __future__ import annotations

import folio
from folio.sampling_params import SamplingParams
from folio.shared.sampling import SamplingParams as OneType


def test_the_module_path_gives_the_one_sampling_struct():
    assert SamplingParams is OneType is folio.SamplingParams
    params = SamplingParams(n=2, temperature=0.5, seed=3, max_tokens=7)
    assert (params.n, params.temperature, params.seed, params.max_tokens) == (2, 0.5, 3, 7)
