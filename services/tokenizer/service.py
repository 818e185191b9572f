"""The tokenizer service: text in, token ids to the scheduler; token ids back, text to the gateway.

Peers (``shared.config.Endpoints``):
- ``recv_from_pipeline`` (PULL, bound at ``tokenizer_in``): ``GenerateRequest``/``AbortRequest``
  from the gateway and ``TokenBatch`` from the scheduler share one inbox, so a client abort and
  the tokens of the same request are seen in the order they arrived;
- ``send_to_scheduler`` (PUSH to ``scheduler_in``): ``EngineRequest``, ``AbortRequest``;
- ``send_to_gateway`` (PUSH to ``gateway_in``): ``TextBatch`` (one per ``TokenBatch``) and error
  deltas for requests that cannot run (prompt + max_tokens beyond the context, bad token ids);
- ``recv_from_admin`` (ROUTER at ``admin_tokenizer``): ``stats``.

All tokenizer work is synchronous CPU work on the event loop; the loop only multiplexes sockets.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import msgspec
import structlog
import zmq
import zmq.asyncio

from services.common import close_sockets, serve_admin
from services.tokenizer.outputs import OutputProcessor, TokenTexts
from shared.config import TokenizerConfig
from shared.messages import AbortRequest, EngineRequest, GenerateRequest, TextBatch, TextDelta, TokenBatch
from shared.transport import Decoder, MalformedMessage, encode, make_socket

log = structlog.get_logger()  # lazy: takes the config setup_logging makes in main


class RequestError(Exception):
    """A request that cannot run; goes back to the client as an HTTP 400."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class TextTokenizer:
    """The HF tokenizer of a model folder plus what the service needs around it."""

    def __init__(self, model_dir: str | Path, max_model_len: int | None = None):
        """``model_dir``: a model folder or a .gguf file (what ``resolve_model`` returns)."""
        from transformers import AutoTokenizer

        model_dir = Path(model_dir)
        if model_dir.suffix == ".gguf":  # a single GGUF file carries its tokenizer and config
            self.hf = AutoTokenizer.from_pretrained(model_dir.parent, gguf_file=model_dir.name)
        else:
            self.hf = AutoTokenizer.from_pretrained(model_dir)
        backend = getattr(self.hf, "backend_tokenizer", None)  # the Rust tokenizer: fast, no Python
        if backend is not None:
            self.decode = lambda ids: backend.decode(ids, skip_special_tokens=True)
            self.decode_with_specials = lambda ids: backend.decode(ids, skip_special_tokens=False)
        else:
            self.decode = lambda ids: self.hf.decode(ids, skip_special_tokens=True)
            self.decode_with_specials = lambda ids: self.hf.decode(ids, skip_special_tokens=False)
        decoder = getattr(backend, "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"  # GPT-2 style: a char per byte
        model_config = _read_model_config(model_dir)
        self.max_model_len = max_model_len or int(model_config.get("max_position_embeddings", 2048))
        self.vocab_size = max(len(self.hf), int(model_config.get("vocab_size", 0)))
        eos = self.hf.eos_token_id if self.hf.eos_token_id is not None else model_config.get("eos_token_id")
        self.eos_token_id = eos[0] if isinstance(eos, list) else eos

    def raw_bytes(self, token_id: int) -> bytes | None:
        """The bytes a token stands for, where the vocabulary says so (byte-level BPE tokens,
        SentencePiece byte fallbacks ``<0xE2>``); None otherwise."""
        token = self.hf.convert_ids_to_tokens(token_id)
        if token is None:
            return None
        fallback = _BYTE_FALLBACK.fullmatch(token)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        if self._byte_level:
            try:
                return bytes(_GPT2_BYTE_DECODER[c] for c in token)
            except KeyError:
                return None
        return None

    def encode_request(self, req: GenerateRequest) -> tuple[list[int], str | None]:
        """(prompt token ids, prompt text when there is one)."""
        if req.prompt_token_ids is not None:
            bad = [t for t in req.prompt_token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})", "prompt")
            return list(req.prompt_token_ids), None
        if req.messages is not None:
            messages = [{"role": m.role, "content": m.content} for m in req.messages]
            try:
                text = self.hf.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                   tokenize=False)
            except Exception as exc:  # jinja raises anything a template author wrote
                raise RequestError(f"the chat template rejected the messages: {exc}", "messages") from exc
            # the template already holds BOS and the role markers
            return self.hf.encode(text, add_special_tokens=False), text
        return self.hf.encode(req.prompt or ""), req.prompt

    def fit_max_tokens(self, req: GenerateRequest, num_prompt_tokens: int) -> int:
        """max_tokens the request may have, or RequestError when it does not fit the context."""
        prompt_param = "messages" if req.messages is not None else "prompt"
        if num_prompt_tokens == 0:
            raise RequestError("the prompt is empty", prompt_param)
        max_tokens = req.sampling.max_tokens
        if req.fill_max_tokens:
            max_tokens = self.max_model_len - num_prompt_tokens
        if max_tokens < 1 or num_prompt_tokens + max_tokens > self.max_model_len:
            wanted = max(max_tokens, 1)  # a prompt that fills the context still asks for one token
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens + wanted} tokens ({num_prompt_tokens} in the {prompt_param}, {wanted} in the "
                f"completion). Please reduce the length of the {prompt_param} or completion.",
                prompt_param if num_prompt_tokens >= self.max_model_len else "max_tokens",
            )
        return max_tokens


class TokenizerService:
    def __init__(self, config: TokenizerConfig, tokenizer: TextTokenizer, ctx: zmq.asyncio.Context | None = None):
        self.config = config
        self.tokenizer = tokenizer
        texts = TokenTexts(tokenizer.decode_with_specials, tokenizer.raw_bytes)
        self.outputs = OutputProcessor(tokenizer.decode, texts)
        self.ctx = ctx or zmq.asyncio.Context.instance()
        ep = config.endpoints
        self.recv_from_pipeline = make_socket(self.ctx, zmq.PULL, ep.tokenizer_in)
        self.send_to_scheduler = make_socket(self.ctx, zmq.PUSH, ep.scheduler_in)
        self.send_to_gateway = make_socket(self.ctx, zmq.PUSH, ep.gateway_in)
        self.recv_from_admin = make_socket(self.ctx, zmq.ROUTER, ep.admin_tokenizer)
        self.decoder = Decoder(GenerateRequest, AbortRequest, TokenBatch)
        self.handlers = {
            GenerateRequest: self.handle_generate,
            AbortRequest: self.handle_abort,
            TokenBatch: self.handle_token_batch,
        }
        self.stats = {"num_generate": 0, "num_aborts": 0, "num_token_batches": 0, "num_malformed": 0,
                      "num_rejected": 0}

    async def run(self) -> None:
        """Serve until cancelled (SIGTERM/SIGINT cancel it from ``main``)."""
        admin = asyncio.ensure_future(serve_admin(self.recv_from_admin, {"stats": self.admin_stats}, log))
        log.info("tokenizer ready", max_model_len=self.tokenizer.max_model_len,
                 inbox=self.config.endpoints.tokenizer_in)
        try:
            while True:
                self.dispatch(await self.recv_from_pipeline.recv())
        finally:
            admin.cancel()

    def close(self) -> None:
        close_sockets(self.recv_from_pipeline, self.send_to_scheduler, self.send_to_gateway, self.recv_from_admin)

    def dispatch(self, data: bytes) -> None:
        """Decode and handle one message; a malformed one or a failing handler never stops us."""
        try:
            message = self.decoder.decode(data)
        except MalformedMessage as exc:
            self.stats["num_malformed"] += 1
            log.warning("malformed message dropped", error=str(exc), num_bytes=len(data), req_id=_sniff_req_id(data))
            return
        try:
            self.handlers[type(message)](message)
        except Exception:
            log.exception("handler failed; message dropped", type=type(message).__name__,
                          req_id=getattr(message, "req_id", None))
            if isinstance(message, GenerateRequest):
                self._reply_error(message.req_id, "internal error while tokenizing", 500)

    def handle_generate(self, req: GenerateRequest) -> None:
        self.stats["num_generate"] += 1
        try:
            prompt_token_ids, prompt_text = self.tokenizer.encode_request(req)
            max_tokens = self.tokenizer.fit_max_tokens(req, len(prompt_token_ids))
        except RequestError as exc:
            self.stats["num_rejected"] += 1
            log.info("request rejected", req_id=req.req_id, reason=str(exc))
            self._reply_error(req.req_id, str(exc), 400, exc.param)
            return
        sampling = req.sampling
        if max_tokens != sampling.max_tokens:
            sampling = msgspec.structs.replace(sampling, max_tokens=max_tokens)
        self.outputs.add_request(req, prompt_token_ids, self.tokenizer.eos_token_id, prompt_text)
        engine_req = EngineRequest(
            req_id=req.req_id,
            prompt_token_ids=prompt_token_ids,
            sampling=sampling,
            eos_token_id=self.tokenizer.eos_token_id,
            priority=req.priority,
            arrival_time=req.arrival_time,
        )
        self.send_to_scheduler.send(encode(engine_req))
        log.debug("request tokenized", req_id=req.req_id, num_prompt_tokens=len(prompt_token_ids))

    def handle_abort(self, abort: AbortRequest) -> None:
        """The gateway's client went away: forget the request, tell the scheduler to free it."""
        self.stats["num_aborts"] += 1
        self.outputs.remove(abort.req_id)
        self.send_to_scheduler.send(encode(abort))
        log.info("request aborted", req_id=abort.req_id, reason=abort.reason)

    def handle_token_batch(self, batch: TokenBatch) -> None:
        self.stats["num_token_batches"] += 1
        deltas, aborts, unknown = self.outputs.process(batch)
        for abort in aborts:
            log.debug("stop string hit", req_id=abort.req_id)
            self.send_to_scheduler.send(encode(abort))
        if unknown:
            log.debug("tokens of finished requests dropped", req_ids=unknown)
        if deltas:
            self.send_to_gateway.send(encode(TextBatch(deltas=deltas)))

    def admin_stats(self, args: dict) -> dict:
        return {**self.stats, "num_requests": len(self.outputs.requests),
                "max_model_len": self.tokenizer.max_model_len}

    def _reply_error(self, req_id: str, message: str, code: int, param: str | None = None) -> None:
        delta = TextDelta(req_id=req_id, finish_reason="error", error=message, error_code=code, error_param=param)
        self.send_to_gateway.send(encode(TextBatch(deltas=[delta])))


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable-character table, reversed: byte-level BPE spells byte b as one
    character, printable bytes as themselves, the others shifted above U+0100."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in printable}
    for i, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = 256 + i
    return {chr(c): b for b, c in chars.items()}


_GPT2_BYTE_DECODER = _gpt2_byte_decoder()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _read_model_config(model_dir: Path) -> dict:
    if model_dir.suffix == ".gguf":
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model_dir.parent, gguf_file=model_dir.name).to_dict()
    path = model_dir / "config.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _sniff_req_id(data: bytes) -> str | None:
    """The req_id of a message that failed validation, when it is readable msgpack at all."""
    try:
        raw = msgspec.msgpack.decode(data)
    except msgspec.MsgspecError:
        return None
    return raw.get("req_id") if isinstance(raw, dict) and isinstance(raw.get("req_id"), str) else None
