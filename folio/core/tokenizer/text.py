"""The model's tokenizer: the HF tokenizer and chat template of a model folder (or .gguf file),
prompt encoding, the context-length check, token bytes, and the answers of ``/tokenize`` and
``/detokenize``.

The tokenizer service (``services/tokenizer/service.py``) builds one ``TextTokenizer`` at start;
the router builds one to hash prompts as the replicas do (``services/router/prompt.py``); tests
build it directly (~1 s for SmolLM2).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec

from folio.shared.messages import (
    ChatMessage,
    ImageInput,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeReply,
    TokenizeRequest,
)
from folio.shared.sampling import ENCODER_ONLY_MODEL_TYPES, SamplingParams


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
            from folio.core.gguf_file import hf_tokenizer

            self.hf = hf_tokenizer(model_dir)
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
        self.max_token_chars = _max_token_chars(self.hf)
        self.hidden_size = int(model_config.get("hidden_size", 0) or 0)  # the most ``dimensions`` of an embedding
        self.matryoshka_dimensions = list(model_config.get("matryoshka_dimensions") or [])
        self.encoder_only = model_config.get("model_type") in ENCODER_ONLY_MODEL_TYPES  # it embeds, nothing else
        self.images = None  # a vision-language model's processor (``vision_inputs.ImagePreprocessor``)
        if model_config.get("vision_config") and model_dir.is_dir():
            from folio.core.tokenizer.vision_inputs import ImagePreprocessor

            self.images = ImagePreprocessor(model_dir, model_config)

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
        ids, text, _ = self.encode_with_images(req)
        return ids, text

    def encode_with_images(self, req: GenerateRequest) -> tuple[list[int], str | None, list[ImageInput]]:
        """(prompt token ids, prompt text, its images through the model's processor)."""
        if req.images:
            return self._encode_images(req)
        if req.prompt_token_ids is not None:
            self.check_token_ids(req.prompt_token_ids, "prompt")
            return list(req.prompt_token_ids), None, []
        if req.messages is not None:
            text = self.render_chat(req.messages, req.tools, req.add_generation_prompt, req.chat_template_kwargs)
            self.check_text_length(text, "messages")
            # the template already holds BOS and the role markers
            return self.hf.encode(text, add_special_tokens=False), text, []
        self.check_text_length(req.prompt or "", "prompt")
        return self.hf.encode(req.prompt or "", add_special_tokens=req.add_special_tokens), req.prompt, []

    def _encode_images(self, req: GenerateRequest) -> tuple[list[int], str, list[ImageInput]]:
        from folio.core.tokenizer.vision_inputs import ImageError

        param = "messages" if req.messages is not None else "prompt"
        if self.images is None:
            raise RequestError(f"this model takes no images: it is a text-only model ({len(req.images)} "
                               "image(s) sent)", param)
        if req.prompt_token_ids is not None:
            raise RequestError("images go with a text prompt or chat messages, not with prompt token ids", param)
        if req.messages is not None:
            text = self.render_chat(req.messages, req.tools, req.add_generation_prompt, req.chat_template_kwargs)
            add_special = False  # the template already holds BOS and the role markers
        else:
            text, add_special = req.prompt or "", req.add_special_tokens
        self.check_text_length(text, param)
        try:
            ids, images = self.images.process(text, list(req.images), add_special)
        except ImageError as exc:
            raise RequestError(str(exc), param) from None
        return ids, text, images

    def check_text_length(self, text: str, param: str) -> None:
        """RequestError, before any tokenizing, for a text that cannot fit the context: no token
        stands for more than ``max_token_chars`` characters, so a text longer than that times the
        context length is more tokens than the context holds, whatever it says. (A text under that
        bound costs at most that many characters of tokenizing, however large the body.)"""
        if self.max_token_chars and len(text) > self.max_token_chars * self.max_model_len:
            at_least = -(-len(text) // self.max_token_chars)
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, the {param} is "
                f"{len(text)} characters, at least {at_least} tokens. Please reduce the length of the {param}.",
                param)

    def render_chat(self, messages: list[ChatMessage], tools: list[dict] | None, add_generation_prompt: bool,
                    template_kwargs: dict | None = None) -> str:
        """The conversation as the chat template writes it, or RequestError. ``template_kwargs``:
        the request's extra template variables; they cannot replace the ones set here."""
        rendered, extra = render_tools(messages, tools, self.hf.chat_template or "")
        reserved = {"conversation", "messages", "tools", "add_generation_prompt", "tokenize", "chat_template"}
        extra = {**{k: v for k, v in (template_kwargs or {}).items() if k not in reserved}, **extra}
        try:
            return self.hf.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt, tokenize=False,
                                               **extra)
        except Exception as exc:  # jinja raises anything a template author wrote
            raise RequestError(f"the chat template rejected the messages: {exc}", "messages") from exc

    def tokenize(self, req: TokenizeRequest) -> TokenizeReply:
        """``/tokenize``: a chat's special tokens come from its template, so ``add_special_tokens``
        adds more only when asked (vLLM's defaults: True for a prompt, False for a chat)."""
        if req.images:  # the ids a generate request of these messages and images gets, placeholders included
            token_ids = self._encode_images(GenerateRequest(
                req_id=req.req_id, prompt=req.prompt, messages=req.messages, tools=req.tools,
                add_generation_prompt=req.add_generation_prompt, images=req.images,
                add_special_tokens=req.add_special_tokens, sampling=SamplingParams()))[0]
        else:
            text = req.prompt or ""
            if req.messages is not None:
                text = self.render_chat(req.messages, req.tools, req.add_generation_prompt)
            token_ids = self.hf.encode(text, add_special_tokens=req.add_special_tokens)
        token_strs = self.hf.convert_ids_to_tokens(token_ids) if req.return_token_strs else None
        return TokenizeReply(req_id=req.req_id, token_ids=token_ids, token_strs=token_strs,
                             max_model_len=self.max_model_len)

    def detokenize(self, req: DetokenizeRequest) -> TokenizeReply:
        """``/detokenize``: the text of the ids, special tokens included (as vLLM decodes them)."""
        self.check_token_ids(req.token_ids, "tokens")
        return TokenizeReply(req_id=req.req_id, text=self.decode_with_specials(req.token_ids),
                             max_model_len=self.max_model_len)

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})", param)

    def prepare(self, req: GenerateRequest) -> tuple[list[int], str | None]:
        """(prompt token ids, prompt text when there is one) of a request that fits the context,
        or RequestError."""
        return self.prepare_prompt(req)[:2]

    def prepare_prompt(self, req: GenerateRequest) -> tuple[list[int], str | None, list[ImageInput]]:
        """``prepare``'s, and the prompt's images (``ImageInput``s; none for a text prompt)."""
        prompt_token_ids, prompt_text, images = self.encode_with_images(req)
        if req.sampling.pooling is not None:
            self.fit_pooling(req.sampling, len(prompt_token_ids))
        elif self.encoder_only:
            raise RequestError("this model is encoder-only: it embeds (/v1/embeddings) and generates no text", "model")
        else:
            self.fit_max_tokens(req, len(prompt_token_ids))
        return prompt_token_ids, prompt_text, images

    def fit_pooling(self, sampling: SamplingParams, num_prompt_tokens: int) -> None:
        """RequestError for a pooling request that cannot run: an empty input, one beyond the
        context, ``dimensions`` the model does not have, a score token outside the vocabulary."""
        if self.encoder_only and sampling.pooling.kind != "embed":
            raise RequestError("this model is encoder-only: it embeds, and has no LM head to score with", "model")
        if num_prompt_tokens == 0:
            raise RequestError("the input is empty", "input")
        if num_prompt_tokens > self.max_model_len:
            raise RequestError(f"This model's maximum context length is {self.max_model_len} tokens. However, the "
                               f"input has {num_prompt_tokens} tokens. Please reduce the length of the input.", "input")
        dims = sampling.pooling.dimensions
        if dims is not None and self.matryoshka_dimensions and dims not in self.matryoshka_dimensions:
            raise RequestError(f"dimensions {dims} is not one this model was trained for: "
                               f"{', '.join(map(str, self.matryoshka_dimensions))}", "dimensions")
        if dims is not None and self.hidden_size and dims > self.hidden_size:
            raise RequestError(f"dimensions must be at most the model's {self.hidden_size}, got {dims}", "dimensions")
        self.engine_sampling(sampling)

    def engine_sampling(self, sampling: SamplingParams) -> SamplingParams:
        """``sampling`` as the engine runs it: a score's tokens resolved to their ids (RequestError
        for a token the vocabulary does not hold as one token)."""
        pooling = sampling.pooling
        if pooling is not None and self.encoder_only:  # its attention is bidirectional (``PoolingParams``)
            if not pooling.bidirectional:
                sampling = msgspec.structs.replace(sampling, pooling=msgspec.structs.replace(pooling,
                                                                                             bidirectional=True))
            return sampling
        if pooling is None or not pooling.tokens or pooling.token_ids:
            return sampling
        ids = []
        for token in pooling.tokens:
            token_id = self.hf.convert_tokens_to_ids(token)
            if token_id is None or (token_id == self.hf.unk_token_id and token != self.hf.unk_token):
                raise RequestError(f"the score token {token!r} is not a token of this model's vocabulary", "pooling")
            ids.append(int(token_id))
        return msgspec.structs.replace(sampling, pooling=msgspec.structs.replace(pooling, token_ids=ids))

    def fit_max_tokens(self, req: GenerateRequest, num_prompt_tokens: int) -> int:
        """The output tokens the request may have (its max_tokens; None: what the context leaves,
        which the scheduler works out again), or RequestError when it does not fit the context."""
        prompt_param = "messages" if req.messages is not None else "prompt"
        if num_prompt_tokens == 0:
            raise RequestError("the prompt is empty", prompt_param)
        max_tokens = req.sampling.max_tokens
        if max_tokens is None:
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


def _max_token_chars(hf) -> int:
    """The most characters any token of the vocabulary stands for (added and special tokens
    included); 0 when the vocabulary cannot be read (then no bound is applied). A byte-level
    token's string has a character per byte, and a byte is at most one character of text."""
    try:
        tokens = list(hf.get_vocab())
    except Exception:  # a tokenizer without a readable vocabulary
        return 0
    longest = max((len(t) for t in tokens), default=0)
    # a normalizer may shorten the text before it is split (NFC composes up to 3 characters into
    # one): the bound is widened unless it only prepends or replaces (SentencePiece's)
    normalizer = getattr(getattr(hf, "backend_tokenizer", None), "normalizer", None)
    kinds = {part.split("(")[0].strip() for part in re.findall(r"\b(\w+)\(", repr(normalizer))} - {"Sequence", "String", "Regex"} \
        if normalizer is not None else set()
    return longest * (4 if kinds - {"Prepend", "Replace"} else 1)


def render_tools(messages: list[ChatMessage], tools: list[dict] | None, template: str) -> tuple[list[dict], dict]:
    """The messages (and ``apply_chat_template``'s extra arguments) for a chat with tools.

    A template that knows tools (Qwen 2.5, Llama 3.1, Hermes ...) gets them as ``tools=`` and the
    calls and results as structured messages; for one that does not (SmolLM2's), the tools go
    into the system message and the calls into the text, the way Hermes/Qwen templates write them
    (``<tool_call>`` JSON), which is what the gateway's parser reads back."""
    knows_tools = "tools" in template
    out = []
    for m in messages:
        d: dict = {"role": m.role, "content": [dict(p) for p in m.parts] if m.parts else m.content}
        if m.tool_calls:
            calls = [{"name": c.name, "arguments": _json_or_text(c.arguments)} for c in m.tool_calls]
            if knows_tools:
                d["tool_calls"] = [{"id": c.id, "type": "function", "function": call}
                                   for c, call in zip(m.tool_calls, calls)]
            else:
                d["content"] = (m.content + "\n" if m.content else "") + "\n".join(
                    f"<tool_call>\n{json.dumps(call)}\n</tool_call>" for call in calls)
        if m.role == "tool":
            if knows_tools:
                d["tool_call_id"] = m.tool_call_id
            else:
                d["content"] = f"<tool_response>\n{m.content}\n</tool_response>"
        out.append(d)
    if not tools:
        return out, {}
    if knows_tools:
        return out, {"tools": tools}
    prompt = _TOOLS_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, {}


_TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


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
        from folio.core.gguf_file import model_config_dict

        return model_config_dict(model_dir)
    path = model_dir / "config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    if isinstance(config.get("text_config"), dict):  # a vision-language model: its text model's sizes
        config = {**config, **{k: v for k, v in config["text_config"].items() if k not in config or k in _TEXT_SIZES}}
    return config


# the sizes a vision-language config gives its text model (the top level may hold the tower's)
_TEXT_SIZES = ("max_position_embeddings", "vocab_size", "hidden_size", "eos_token_id")
