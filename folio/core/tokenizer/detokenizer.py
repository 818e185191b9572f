"""Incremental detokenization and stop strings, one request at a time.

Used by the tokenizer service (``folio/core/tokenizer/output_processor.py``) for every token the scheduler
sends back. Two pieces:

- ``IncrementalDetokenizer`` turns token ids into text one token at a time without ever emitting a
  split multi-byte character. Byte-level BPE tokens can carry part of a UTF-8 sequence (an emoji is
  often two or three tokens); decoding them alone gives U+FFFD. Like vLLM, we decode a short window
  twice — the tokens already emitted (``prefix_offset:read_offset``) and the window with the new
  ones (``prefix_offset:``) — and emit only the difference, holding everything back while the
  window ends in U+FFFD. The window's leading context also keeps SentencePiece's leading-space
  handling right (decoding a token alone drops its space).
- ``StopChecker`` finds stop strings in the text stream, also when one spans several tokens, and
  holds back a tail that could still grow into a stop string, so a stop string never reaches the
  client, not even in part.
"""

from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"
# prompt tokens kept as decoding context: enough for SentencePiece's space and byte fallbacks
NUM_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Text of one request's output tokens, emitted as soon as it is whole.

    ``decode`` is a ``list[int] -> str`` function (a ``tokenizers.Tokenizer.decode`` with special
    tokens skipped); ``prompt_token_ids`` give the first decoding context.
    """

    def __init__(self, decode, prompt_token_ids: list[int]):
        self._decode = decode
        self._token_ids = list(prompt_token_ids[-NUM_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)

    def add(self, token_id: int) -> str:
        """Add one token; return the text that became complete (often ``""`` mid-character)."""
        ids = self._token_ids
        ids.append(token_id)
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""  # an unfinished character (or a token with no text): wait for more bytes
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        if self._prefix_offset > 4 * NUM_CONTEXT_TOKENS:  # keep the list short on long outputs
            drop = self._prefix_offset
            del ids[:drop]
            self._prefix_offset -= drop
            self._read_offset -= drop
        return new_text[len(prefix_text) :]

    @property
    def has_pending(self) -> bool:
        """Tokens were added whose text is not out yet (an unfinished multi-byte character)."""
        return self._read_offset < len(self._token_ids)


class StopChecker:
    """Cut the text stream at the first stop string; hold back what may be a stop string's start."""

    def __init__(self, stop: list[str]):
        self._stop = [s for s in stop if s]
        self._held = ""

    @property
    def active(self) -> bool:
        """There are stop strings to look for (else ``feed`` passes text through)."""
        return bool(self._stop)

    def feed(self, text: str) -> tuple[str, str | None]:
        """Add new text; return (text safe to emit, the stop string that matched or None).

        After a match the text up to (not including) the stop string is returned and the checker
        must not be fed again.
        """
        if not self._stop:
            return text, None
        buf = self._held + text
        match = _earliest_match(buf, self._stop)
        if match is not None:
            index, stop = match
            self._held = ""
            return buf[:index], stop
        keep = _partial_stop_len(buf, self._stop)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], None

    def flush(self) -> str:
        """The held-back tail, once the request finished without completing a stop string."""
        held, self._held = self._held, ""
        return held


def _earliest_match(text: str, stop: list[str]) -> tuple[int, str] | None:
    """(index, stop string) of the stop string that starts first in ``text``."""
    best = None
    for s in stop:
        i = text.find(s)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


def _partial_stop_len(text: str, stop: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    longest = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest
