"""The sampler's columns: where a request's ``SamplingParams`` becomes the numbers the sampler
reads, in one function (``column_values``), for the torch sampler (``SamplingBatch.params``) and
for the C kernel's tables (the runner's persistent batch) alike.

``COLUMNS`` names them in order; ``csrc/sampler.c`` reads them by the index constants of the
``FOLIO_SAMPLER_COLUMNS`` list in ``csrc/folio.h``, which must be the same names in the same order
(checked when the library loads, ``cpu_kernels.check_sampler_columns``). Every other field of the struct is named in
``NOT_COLUMNS`` with what reads it instead, so that a new field is either a column or set apart on
purpose (``tests/executor/test_sampler_columns.py``). No torch here.
"""

from __future__ import annotations

from folio.shared.sampling import SamplingParams

COLUMNS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "top_k")
TEMPERATURE, TOP_P, MIN_P, PRESENCE, FREQUENCY, REPETITION, TOP_K = (COLUMNS.index(name) for name in (
    "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "top_k"))
NUM_PARAMS = len(COLUMNS)

# the struct's fields that are no column, and what reads them
NOT_COLUMNS = {
    "n": "the request's choices (input_processor.generate_request)",
    "best_of": "the request's sequences and their ranking (input_processor, the gateway, folio.outputs)",
    "seed": "the seeds table: each row's Philox key (input_batch.seeds)",
    "max_tokens": "the scheduler (Request.max_tokens)",
    "stop": "the tokenizer's stop-string check",
    "stop_token_ids": "the scheduler (Request.stop_reason)",
    "ignore_eos": "the scheduler (Request.stop_reason)",
    "logprobs": "the runner's logprobs table (input_batch.num_logprobs, through engine_logprobs)",
    "prompt_logprobs": "the runner (prompt logprobs)",
    "use_beam_search": "the scheduler's beam search (forks.add_beam_search)",
    "length_penalty": "the scheduler's beam search (forks.add_beam_search)",
    "early_stopping": "the scheduler's beam search (forks.add_beam_search)",
    "pooling": "the runner's pooling rows (input_batch.pooling, runtime/pooling.py): they never sample",
}


def column_values(params: SamplingParams, vocab_size: int) -> list[float]:
    """One row of the columns, in ``COLUMNS`` order. A greedy row (``params.greedy``, its own
    table) keeps temperature 1: it never divides by it. Top-k off (0) is the whole vocabulary;
    -0.0 penalties become +0.0 (the kernel tells a neutral row by its penalties' bits)."""
    values = {
        "temperature": 1.0 if params.greedy else params.temperature,
        "top_p": params.top_p,
        "min_p": params.min_p,
        "presence_penalty": params.presence_penalty + 0.0,
        "frequency_penalty": params.frequency_penalty + 0.0,
        "repetition_penalty": params.repetition_penalty,
        "top_k": float(vocab_size if params.top_k == 0 else min(params.top_k, vocab_size)),
    }
    return [values[name] for name in COLUMNS]
