"""512 SSE streams at once through the real gateway and tokenizer processes (``folio run``), fed
by the stream benchmark's fake back half at a fixed step rate (``folio/bench/streams.py``):
every stream must end with status 200, ``[DONE]``, its whole text (characters split across tokens
included), finish reason ``length`` and the right usage. No speed is asserted: the benchmark
measures that."""

from __future__ import annotations

import asyncio

import pytest

from folio.bench.streams import run_bench
from folio.shared.config import DEFAULT_MODEL_NAME

NUM_STREAMS = 512
MAX_TOKENS = 18  # past the script's split characters (数据流, 🚀), which must arrive whole


@pytest.mark.slow  # about 7.5 s of load
def test_512_streams_all_complete_with_their_whole_text():
    result = asyncio.run(run_bench(DEFAULT_MODEL_NAME, NUM_STREAMS, MAX_TOKENS, step_s=0.01, timeout_s=120.0))
    assert result["num_unfinished"] == 0
    streams = result["streams"]
    assert len(streams) == NUM_STREAMS
    expected = result["expected_text"]
    assert "\U0001f680" in expected and "\ufffd" not in expected  # a character split across tokens is in play
    for i, s in enumerate(streams):
        assert s["status"] == 200, (i, s)
        assert s["done"], (i, s)
        assert s["text"] == expected, (i, s["text"], expected)
        assert s["finish_reasons"] == ["length"], (i, s)
        assert s["completion_tokens"] == MAX_TOKENS, (i, s)
