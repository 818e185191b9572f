"""folio's offline API: ``from folio import LLM, SamplingParams`` (see ``folio/llm.py``)."""

from folio.llm import LLM
from folio.outputs import CompletionOutput, Logprob, RequestOutput
from folio.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
