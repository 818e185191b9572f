"""Disaggregated serving through the router: ``folio run router --prefill URL ... --decode URL ...``
(each URL takes ``--replica``'s ``,kv_events_port=P,kv_snapshot_port=Q`` suffixes).

More in docs/modules.md (services/router/disagg.py).
"""

from __future__ import annotations

import copy
import asyncio
import json
from urllib.parse import urlsplit

import aiohttp
import structlog
from aiohttp import web

from folio.services.router.replicas import Replica, parse_replica
from folio.services.router.resume import ClientGone, to_client
from folio.shared.keys import KeysError, sign
from folio.services.shell import StartError
from folio.shared.curve import stack_keys

HANDLE_TTL_S = 300.0  # a signed handle's life: as long as the prefill side keeps its blocks (STAGING_TTL_S)

log = structlog.get_logger()
_RETRY_STATUSES = (502, 503, 504)
_NO_DECODE = {"error": {"message": "no decode instance could take the request", "type": "service_unavailable",
                         "param": None, "code": None}}


class _LegFailed(Exception):
    """This instance did not answer the leg: try another."""


def role_names(config) -> tuple[set[str], set[str]]:
    """The replica names (``parse_replica``'s) of the prefill and the decode instances."""
    def names(specs):
        return {parse_replica(s, config.kv_events_port, config.kv_snapshot_port).name for s in specs}
    return names(config.prefill), names(config.decode)


class Disaggregated:
    def __init__(self, service):
        self.service = service
        self.prefill_names, self.decode_names = role_names(service.config)
        self.peer_keys = self._peer_keys(service.config)  # decode instance -> the z85 key its transfers are for
        self.counts = {"num_disagg_requests": 0, "num_prefill_retries": 0, "num_decode_retries": 0,
                       "num_colocated_fallbacks": 0, "num_decode_resumes": 0, "num_first_token_only": 0,
                       "num_client_disconnects": 0}

    @staticmethod
    def _peer_keys(config) -> dict[str, str]:
        keys = stack_keys()
        if keys is None:
            return {}
        out = {}
        for spec in config.decode:
            replica = parse_replica(spec, config.kv_events_port, config.kv_snapshot_port)
            try:
                public = keys.public_of(replica.peer_key) if replica.peer_key else keys.client_public
            except KeysError as exc:
                raise StartError("a --decode instance's key is not in the key folder", replica=replica.name,
                                 error=str(exc)) from None
            out[replica.name] = public.decode("ascii")
        return out

    def _pick_decode(self) -> Replica | None:
        """The decode instance the decode leg goes to first (picked before the prefill leg: its key is
        the one the transfer is staged for)."""
        decision = self.service.router.choose(self._of(self.decode_names), None, None, set())
        return decision.replica if decision is not None else None

    def _of(self, names: set[str]) -> list[Replica]:
        return [r for r in self.service.replicas.replicas.values() if r.name in names]

    # ------------------------------------------------------------------ entry
    async def generate(self, request: web.Request, body: dict, token_ids: list[int] | None,
                       salt: str | None) -> web.StreamResponse:
        self.counts["num_disagg_requests"] += 1
        n = body.get("n") or 1
        if not isinstance(n, int) or isinstance(n, bool) or n < 1 or body.get("best_of") not in (None, 1) \
                or body.get("use_beam_search") or not isinstance(body.get("prompt", ""), (str, list)) \
                or (isinstance(body.get("prompt"), list) and body["prompt"] and not isinstance(body["prompt"][0], int)):
            # what one prefill/decode pair cannot split (best_of, beams, several prompts): colocated
            return await self._colocated(request, json.dumps(body).encode())
        bodies = [self._choice_body(body, i) for i in range(n)]
        if body.get("stream"):
            return await self._stream(request, body, bodies, token_ids, salt)
        answers = await asyncio.gather(*(self._one(request, b, token_ids, salt) for b in bodies))
        for status, payload in answers:
            if status != 200:
                return web.json_response(payload, status=status)
        return web.json_response(self._merge(answers))

    def _choice_body(self, body: dict, i: int) -> dict:
        b = {**body, "n": 1}
        if i and isinstance(body.get("seed"), int):
            b["seed"] = body["seed"] + i if body["seed"] + i < 2**63 else body["seed"] - i  # with_seed_offset's
        return b

    # ------------------------------------------------------------------ the prefill leg
    async def _prefill(self, request, body: dict, token_ids, salt,
                       decode: Replica | None = None) -> tuple[Replica, dict] | None:
        """(the prefill instance, its answer) or None when none could take it; the transfer is
        staged for ``decode``'s key."""
        leg = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens")}
        export = {"export": True}
        if decode is not None and decode.name in self.peer_keys:
            export["export_to"] = self.peer_keys[decode.name]
        leg.update(max_tokens=1, kv_transfer=export)
        raw = json.dumps(leg).encode()
        tried: set[str] = set()
        for _ in range(max(1, len(self.prefill_names))):
            decision = self.service.router.choose(self._of(self.prefill_names), token_ids, salt, tried)
            if decision is None:
                return None
            tried.add(decision.replica.name)
            self.service._count(decision, token_ids)
            try:
                status, payload = await self._post(request, decision.replica, raw)
            except _LegFailed as exc:
                self.counts["num_prefill_retries"] += 1
                log.info("prefill leg failed: another prefill instance", replica=decision.replica.name, cause=str(exc))
                continue
            if status != 200:
                return decision.replica, {"status": status, "payload": payload}
            return decision.replica, payload
        return None

    async def _post(self, request, replica: Replica, raw: bytes) -> tuple[int, dict]:
        replica.num_inflight += 1
        try:
            async with self.service.session.post(replica.name + request.path, data=raw,
                                                 headers=self._headers(request)) as up:
                if up.status in _RETRY_STATUSES:
                    raise _LegFailed(f"http_{up.status}")
                return up.status, await up.json(content_type=None)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError, ValueError) as exc:
            if not isinstance(exc, ValueError):
                self.service.replicas.mark_down(replica, f"request: {type(exc).__name__}: {exc}")
            raise _LegFailed(type(exc).__name__) from exc
        finally:
            replica.num_inflight -= 1

    def _headers(self, request) -> dict:
        return {h: request.headers[h] for h in ("Authorization", "Content-Type") if h in request.headers}

    @staticmethod
    def _decode_body(body: dict, prefill: Replica, answer: dict) -> dict:
        kt = answer["kv_transfer"]
        host = urlsplit(prefill.name).hostname
        host = f"[{host}]" if ":" in host else host
        handle = {"transfer_id": kt["transfer_id"], "endpoint": f"tcp://{host}:{kt['port']}",
                  "num_blocks": kt["num_blocks"], "num_tokens": kt["num_prompt_tokens"]}
        keys = stack_keys()
        if keys is not None:  # a decode instance takes a handle only signed with the stack's key
            handle = sign(keys, handle, HANDLE_TTL_S)
        return {**body, "kv_transfer": {"handle": handle, "forced_token_ids": kt["token_ids"]}}

    @staticmethod
    def _first(answer: dict) -> tuple[str, str | None]:
        """The first token's text and the prefill leg's finish reason."""
        choice = answer["choices"][0]
        text = choice["text"] if "text" in choice else (choice.get("message") or {}).get("content") or ""
        return text, choice.get("finish_reason")

    def _ends_at_first(self, body: dict, answer: dict) -> bool:
        _, finish = self._first(answer)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        return finish == "stop" or max_tokens == 1

    # ------------------------------------------------------------------ one choice, not streamed
    async def _one(self, request, body: dict, token_ids, salt) -> tuple[int, dict]:
        decode = self._pick_decode()
        got = await self._prefill(request, body, token_ids, salt, decode)
        if got is None:
            self.counts["num_colocated_fallbacks"] += 1
            return await self._decode_json(request, body)
        prefill, answer = got
        if "status" in answer and "payload" in answer:  # the prefill instance refused it: the client's error
            return answer["status"], answer["payload"]
        if self._ends_at_first(body, answer):
            self.counts["num_first_token_only"] += 1
            answer.pop("kv_transfer", None)
            return 200, answer
        status, decoded = await self._decode_json(request, self._decode_body(body, prefill, answer), decode)
        if status != 200:
            return status, decoded
        text, _ = self._first(answer)
        choice = decoded["choices"][0]
        if "text" in choice:
            choice["text"] = text + choice["text"]
        elif choice.get("message") is not None and choice["message"].get("content") is not None:
            choice["message"]["content"] = text + choice["message"]["content"]
        return 200, decoded

    async def _decode_json(self, request, body: dict, first: Replica | None = None) -> tuple[int, dict]:
        raw = json.dumps(body).encode()

        def failed(replica, exc) -> None:
            self.counts["num_decode_retries"] += 1
            log.info("decode leg failed: another decode instance", replica=replica.name, cause=str(exc))

        answer = await self._on_a_decode_instance(lambda replica: self._post(request, replica, raw), _LegFailed, failed,
                                                  first)
        return answer if answer is not None else (503, copy.deepcopy(_NO_DECODE))

    async def _on_a_decode_instance(self, attempt, errors, failed, first: Replica | None = None):
        """``attempt(replica)`` on the decode instances the router picks (``first`` first, while it is
        up), one after another while it raises one of ``errors`` (``failed(replica, exc)`` is told);
        None when none answered."""
        tried: set[str] = set()
        for _ in range(max(1, len(self.decode_names))):
            replica = self._next_decode(first, tried)
            if replica is None:
                break
            tried.add(replica.name)
            try:
                return await attempt(replica)
            except errors as exc:
                failed(replica, exc)
        return None

    def _next_decode(self, first: Replica | None, tried: set[str]) -> Replica | None:
        if first is not None and not tried and first.up:
            return first
        decision = self.service.router.choose(self._of(self.decode_names), None, None, tried)
        return decision.replica if decision is not None else None

    @staticmethod
    def _merge(answers: list[tuple[int, dict]]) -> dict:
        out = answers[0][1]
        if len(answers) == 1:
            return out
        choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        for i, (_, a) in enumerate(answers):
            for c in a["choices"]:
                choices.append({**c, "index": i})
            u = a.get("usage") or {}
            usage["prompt_tokens"] = u.get("prompt_tokens", 0)
            usage["completion_tokens"] += u.get("completion_tokens", 0)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return {**out, "choices": choices, "usage": {**(out.get("usage") or {}), **usage}}

    async def _colocated(self, request, raw: bytes) -> web.StreamResponse:
        self.counts["num_colocated_fallbacks"] += 1

        def failed(replica, exc) -> None:  # the router's _Retry, a connection error
            log.info("colocated attempt failed", replica=replica.name, cause=str(exc))

        response = await self._on_a_decode_instance(lambda replica: self.service._forward(request, replica, raw),
                                                     Exception, failed)
        return response if response is not None else web.json_response(_NO_DECODE, status=503)

    # ------------------------------------------------------------------ streamed
    async def _stream(self, request, body: dict, bodies: list[dict], token_ids, salt) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                           "Cache-Control": "no-cache"})
        prepared = False
        lock = asyncio.Lock()

        async def write(data: bytes) -> None:
            nonlocal prepared
            async with lock:
                if not prepared:
                    await response.prepare(request)
                    prepared = True
                await to_client(response, data)

        results = await asyncio.gather(*(self._stream_one(request, b, i, token_ids, salt, write)
                                         for i, b in enumerate(bodies)), return_exceptions=True)
        if gone := [r for r in results if isinstance(r, ClientGone)]:
            # the client left: the legs' connections closed with their streams, so the decode
            # instances abort; nothing is wrong with them
            self.counts["num_client_disconnects"] += 1
            log.info("client closed its stream", cause=str(gone[0]))
            return response
        errors = [r for r in results if isinstance(r, tuple)]
        if not prepared and errors:
            status, payload = errors[0]
            return web.json_response(payload, status=status)
        try:
            if not prepared:
                await response.prepare(request)
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionError as exc:
            self.counts["num_client_disconnects"] += 1
            log.info("client closed its stream", cause=str(exc))
        return response

    async def _stream_one(self, request, body: dict, index: int, token_ids, salt, write):
        """One choice's stream, events re-indexed ``index``; (status, error) when it could not start."""
        decode = self._pick_decode()
        got = await self._prefill(request, body, token_ids, salt, decode)
        if got is None:
            self.counts["num_colocated_fallbacks"] += 1
            return await self._decode_stream(request, body, index, write, skip="")
        prefill, answer = got
        if "status" in answer and "payload" in answer:
            return answer["status"], answer["payload"]
        text, finish = self._first(answer)
        chat = "message" in answer["choices"][0]
        ends = self._ends_at_first(body, answer)
        await write(_event(self._first_chunk(answer, index, text, chat, finish if ends else None)))
        if ends:
            self.counts["num_first_token_only"] += 1
            return None
        return await self._decode_stream(request, self._decode_body(body, prefill, answer), index, write, skip="",
                                         delivered=text, original=body, first=decode)

    @staticmethod
    def _first_chunk(answer: dict, index: int, text: str, chat: bool, finish: str | None) -> dict:
        base = {"id": answer["id"], "created": answer["created"], "model": answer["model"]}
        if chat:
            return {**base, "object": "chat.completion.chunk", "choices": [
                {"index": index, "delta": {"role": "assistant", "content": text}, "logprobs": None,
                 "finish_reason": finish}]}
        return {**base, "object": "text_completion", "choices": [
            {"index": index, "text": text, "logprobs": None, "finish_reason": finish}]}

    async def _decode_stream(self, request, body: dict, index: int, write, skip: str, delivered: str = "",
                             original: dict | None = None, first: Replica | None = None):
        """Pipe a decode leg's stream to the client; on a break, again elsewhere without the handle,
        skipping the text delivered already."""
        tried: set[str] = set()
        first_prefix = delivered  # the prefill leg's text: not in a decode leg's stream
        for attempt in range(max(1, len(self.decode_names)) + 1):
            replica = self._next_decode(first, tried)
            if replica is None:
                break
            tried.add(replica.name)
            leg = {**body, "stream": True}
            replica.num_inflight += 1
            try:
                async with self.service.session.post(replica.name + request.path, data=json.dumps(leg).encode(),
                                                     headers=self._headers(request)) as up:
                    if up.status in _RETRY_STATUSES:
                        raise _LegFailed(f"http_{up.status}")
                    if up.status != 200:
                        return up.status, await up.json(content_type=None)
                    # the text this leg would repeat: what the client holds past the leg's own start
                    to_skip = delivered[len(first_prefix):] if body.get("kv_transfer") else delivered
                    finished = False
                    buf = b""
                    async for chunk in up.content.iter_any():
                        buf += chunk
                        while b"\n\n" in buf:
                            event, buf = buf.split(b"\n\n", 1)
                            data = event.removeprefix(b"data: ").strip()
                            if not data or data == b"[DONE]":
                                finished = finished or data == b"[DONE]"
                                continue
                            out, to_skip, text = _reindex(data, index, to_skip)
                            delivered += text
                            if out is not None:
                                await write(_event(out))
                    if finished:
                        return None
                    raise aiohttp.ClientPayloadError("the stream ended without [DONE]")
            except (_LegFailed, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError) as exc:
                if not isinstance(exc, _LegFailed):
                    self.service.replicas.mark_down(replica, f"stream: {type(exc).__name__}: {exc}")
                self.counts["num_decode_resumes" if delivered != first_prefix else "num_decode_retries"] += 1
                log.info("decode leg broke: resuming on another decode instance", replica=replica.name,
                         cause=str(exc), delivered_chars=len(delivered))
                if delivered != first_prefix:  # the handle may be spent: recompute there, skip what was sent
                    body = {**(original or body)}
                    body.pop("kv_transfer", None)
                    first_prefix = ""
            finally:
                replica.num_inflight -= 1
        return 503, {"error": {"message": "no decode instance could finish the request", "type": "service_unavailable",
                               "param": None, "code": None}}


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _reindex(data: bytes, index: int, to_skip: str) -> tuple[dict | None, str, str]:
    """A decode leg's event for the client: choice ``index``, the text the client has already cut
    off the front. Returns (the event or None when nothing is left of it, the text still to skip,
    the text it delivers)."""
    obj = json.loads(data)
    delivered = ""
    for c in obj.get("choices", []):
        c["index"] = index
        key, holder = ("text", c) if "text" in c else ("content", c.get("delta") or {})
        text = holder.get(key) or ""
        if to_skip and text:
            cut = min(len(to_skip), len(text))
            if text[:cut] != to_skip[:cut]:
                to_skip = ""  # it differs from what was sent (an unseeded sample): go on from here
            else:
                text, to_skip = text[cut:], to_skip[cut:]
            holder[key] = text
        delivered += text
    if not obj.get("choices") and obj.get("usage") is None:
        return None, to_skip, delivered
    if obj.get("choices") and not any((c.get("text") or (c.get("delta") or {}).get("content")
                                       or c.get("finish_reason") or (c.get("delta") or {}).get("tool_calls"))
                                      for c in obj["choices"]):
        return None, to_skip, delivered
    return obj, to_skip, delivered
