"""The handle of a KV transfer (``folio.core.executor.runtime.kv_transfer``): where a prefill
instance holds a request's prompt KV for a decode instance to pull. It travels prefill gateway ->
router -> decode gateway (the ``kv_transfer`` extension field) -> scheduler -> executor, so it
lives here, free of torch."""

from __future__ import annotations

import msgspec


class TransferHandle(msgspec.Struct, frozen=True, kw_only=True):
    """Where and what to pull."""

    transfer_id: str
    endpoint: str  # the sender's socket, tcp://host:port
    num_blocks: int
    num_tokens: int = 0  # the prompt tokens the blocks hold

    def to_wire(self) -> dict:
        return msgspec.to_builtins(self)

    @classmethod
    def from_wire(cls, d: object) -> "TransferHandle":
        """Validated: a malformed handle is a ValueError naming the problem."""
        try:
            h = msgspec.convert(d, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"invalid kv transfer handle: {exc}") from None
        if not h.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"invalid kv transfer handle: endpoint {h.endpoint!r} is not a ZeroMQ address")
        if h.num_blocks < 0 or h.num_tokens < 0 or not h.transfer_id:
            raise ValueError("invalid kv transfer handle: negative counts or an empty transfer id")
        return h
