"""Stream chunks of new text only come from a ``TextChunkTemplate`` (encoded once, then only the
text): they must be byte for byte what encoding the whole chunk gives, for any text."""

from __future__ import annotations

import msgspec
import pytest

from folio.services.gateway import responses
from folio.shared.messages import TextDelta

TEXTS = [" hi", 'a "quote" and a \\ backslash', "é 数据流 🚀", "\n\t\x01\x00", "</script>\u2028", ""]


@pytest.mark.parametrize("with_usage", [False, True])
@pytest.mark.parametrize("index", [0, 3])
def test_text_templates_encode_like_the_whole_chunk(index, with_usage):
    meta = responses.ResponseMeta(id="cmpl-1", created=1700000000, model='odd "model" \\ name', n=2, echo=True)
    completion = responses.completion_text_template(meta, index, with_usage)
    chat = responses.chat_text_template(meta, index, with_usage)
    for text in TEXTS:
        delta = TextDelta(req_id="r", text=text, token_ids=[1])
        choice = responses.completion_choice(index, delta, meta.echo, first=False)
        assert completion.encode(text) == msgspec.json.encode(responses.completion_chunk(meta, [choice], None, with_usage))
        chat_choice = responses.chat_chunk_choice(index, TextDelta(req_id="r", text=text or "x"))
        assert chat.encode(text or "x") == msgspec.json.encode(responses.chat_chunk(meta, [chat_choice], None, with_usage))


def test_a_template_needs_its_marker_once():
    with pytest.raises(ValueError):
        responses.TextChunkTemplate({"text": "no marker"})
    mark = responses.TextChunkTemplate.MARK
    with pytest.raises(ValueError):
        responses.TextChunkTemplate({"a": mark, "b": mark})
