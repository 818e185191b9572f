"""The OpenAI request bodies the gateway accepts, validated declaratively, and its error objects.

``routes.py`` decodes each body with ``parse(body, CompletionRequest)`` (or another request type):
types and OpenAI's ranges are ``msgspec`` annotations on the structs below; the rules of the HTTP
API's own fields (prompts, streaming, structured output, tools) are the ``(param, is_bad, message)``
rows of ``_COMMON_RULES``/``_COMPLETION_RULES``/``_CHAT_RULES``. A body's ``sampling_params()`` is
its one ``SamplingParams`` (``shared/sampling.py``), whose own rules, shared with
``folio.LLM``, are checked as it is built.
Anything wrong becomes an ``ApiError`` that the routes turn into an OpenAI error object.
Unknown fields are ignored, as OpenAI does (clients send extras such as ``user``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from folio.core.input_processor import ChatMessageIn
from folio.shared.sampling import ParamError, SamplingParams

MAX_N = 128  # choices per prompt: each is a sequence in the batch
MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs
MAX_STOP_CHARS = 1024  # one stop string: the tokenizer checks every one against each delta
MAX_TOOLS = 128  # tools in one request (OpenAI's cap): each schema is rendered into the prompt

# bounded so every accepted value fits the msgpack ints of the wire; the tokenizer checks the
# vocabulary and the context length
TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]
PosInt = Annotated[int, Meta(ge=1, le=2**31 - 1)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]


class ApiError(Exception):
    """An HTTP error with an OpenAI error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = message, status, param, code, type_

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: Annotated[str, Meta(min_length=1, max_length=64)] = "response"
    schema: dict | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class KVTransferParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Disaggregated serving, between the router and the gateways (an extension, not for clients).
    ``export``: a prefill instance (``--kv-role prefill``) computes the prompt and the first token
    and answers with the transfer's handle and the token's id (``responses``' ``kv_transfer``).
    ``handle`` with ``forced_token_ids``: a decode instance pulls the prompt's KV from the handle
    and goes on after those tokens (the prefill side's first token: output position 0).
    ``export_to`` (with ``export``): the z85 CURVE public key of the decode instance the transfer is
    served to, and to no other peer."""

    export: bool = False
    export_to: Annotated[str, Meta(pattern=r"^[0-9A-Za-z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")] | None = None
    handle: dict | None = None
    forced_token_ids: Annotated[list[TokenId], Meta(max_length=64)] = []


class ContinueChoice(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One choice of a stream resumed on this replica (the router's extension, ``continue_choices``):
    the token ids its client already has (their text is not sent again), or ``finished``."""

    index: Annotated[int, Meta(ge=0)]
    token_ids: list[TokenId] = []
    finished: bool = False


class _Params(msgspec.Struct, kw_only=True):
    """Fields both endpoints take. ``None`` means "not given": the ``SamplingParams`` default
    applies (OpenAI's and vLLM's agree). The sampling fields carry OpenAI's types and its ranges
    where they are narrower than ``SamplingParams``' rules (temperature up to 2, penalties within
    +-2); everything else about them is checked by the struct (``sampling_params``)."""

    model: str | None = None
    max_tokens: PosInt | None = None
    temperature: Annotated[float, Meta(le=2.0)] | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0 and -1: off
    min_p: float | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(le=10.0)] | None = None
    seed: Int64 | None = None
    stop: Annotated[str, Meta(max_length=MAX_STOP_CHARS)] | \
        Annotated[list[Annotated[str, Meta(max_length=MAX_STOP_CHARS)]], Meta(max_length=4)] | None = None
    stop_token_ids: list[TokenId] | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    # vLLM's extra parameter: prefix-cache blocks are shared only between requests with equal salts
    cache_salt: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    # vLLM's: with --scheduling-policy priority, lower values are scheduled first
    priority: Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)] = 0
    # structured output: OpenAI's response_format and vLLM's guided_* extra parameters
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Meta(min_length=1)] | None = None
    guided_grammar: str | None = None
    kv_transfer: KVTransferParams | None = None  # router <-> gateway only (``KVTransferParams``)
    # vLLM's: each streamed choice also carries the ``token_ids`` of its delta
    return_token_ids: bool = False
    # router <-> gateway: this request continues a stream another replica began (``ContinueChoice``;
    # choices not named start from the beginning)
    continue_choices: Annotated[list[ContinueChoice], Meta(max_length=MAX_N * 64)] | None = None

    def _sampling(self, **endpoint) -> SamplingParams:
        """The body's ``SamplingParams``: the fields both name, as given, then ``endpoint`` (the
        fields this endpoint maps its own way); a value the struct refuses is a 400 naming it."""
        given = {name: getattr(self, name) for name in SamplingParams.__struct_fields__
                 if name in self.__struct_fields__ and getattr(self, name) is not None}
        if self.temperature is None and given.get("use_beam_search"):
            given["temperature"] = 0.0  # beams run greedy: their default temperature
        try:
            return SamplingParams(**{**given, **endpoint})
        except ParamError as exc:
            raise ApiError(str(exc), param=exc.param) from None


class CompletionRequest(_Params, kw_only=True):
    # a string, a list of strings, a list of token ids, or a list of token-id lists
    prompt: str | list[str | TokenId | list[TokenId]]
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Meta(ge=1, le=MAX_N)] | None = None
    # vLLM's beam-search parameters: ``n`` beams (``best_of`` if larger), the best ``n`` returned
    use_beam_search: bool = False
    length_penalty: Annotated[float, Meta(ge=-10.0, le=10.0)] = 1.0
    early_stopping: bool | Literal["never"] = False

    def sampling_params(self) -> SamplingParams:
        # echo with logprobs also returns the prompt tokens' logprobs, as OpenAI does
        return self._sampling(prompt_logprobs=self.logprobs if self.echo and self.logprobs is not None else None)


class FunctionDef(msgspec.Struct, kw_only=True):
    name: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Params, kw_only=True):
    messages: Annotated[list[ChatMessageIn], Meta(min_length=1)]
    tools: Annotated[list[Tool], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_completion_tokens: PosInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    # vLLM's: extra variables for the chat template (Qwen3's ``enable_thinking``)
    chat_template_kwargs: dict | None = None

    def sampling_params(self) -> SamplingParams:
        # chat's logprobs is a flag with top_logprobs beside it; without a token limit the reply
        # may have all the context the prompt leaves (max_tokens None)
        return self._sampling(max_tokens=self.max_completion_tokens or self.max_tokens,
                              logprobs=(self.top_logprobs or 0) if self.logprobs else None)


class TokenizeCompletionRequest(msgspec.Struct, kw_only=True):
    """``/tokenize`` of a prompt (vLLM's body)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(msgspec.Struct, kw_only=True):
    """``/tokenize`` of a conversation through the chat template (vLLM's body)."""

    model: str | None = None
    messages: Annotated[list[ChatMessageIn], Meta(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template holds them already
    return_token_strs: bool = False
    tools: Annotated[list[Tool], Meta(max_length=MAX_TOOLS)] | None = None


class DetokenizeBody(msgspec.Struct, kw_only=True):
    """``/detokenize`` (vLLM's body)."""

    model: str | None = None
    tokens: list[TokenId]


Rule = tuple[str, Callable[[msgspec.Struct], bool], str]


def _kv_transfer_bad(r) -> str | None:
    """Why a ``kv_transfer`` extension cannot be served (None: it can); its handle is checked apart."""
    kt = r.kv_transfer
    if (r.n or 1) > 1 or getattr(r, "best_of", None) not in (None, 1) or getattr(r, "use_beam_search", False):
        return "n"
    if isinstance(getattr(r, "prompt", ""), list) and r.prompt and not isinstance(r.prompt[0], int):
        return "prompts"
    if kt.export == (kt.handle is not None):
        return "export xor handle"
    if kt.export_to is not None and not kt.export:
        return "export_to without export"
    if kt.export and (r.stream or kt.forced_token_ids):
        return "export streamed"
    if kt.handle is not None and not kt.forced_token_ids:
        return "forced tokens"
    return None


def _prompt_kind_mixed(req: CompletionRequest) -> bool:
    p = req.prompt
    if isinstance(p, str):
        return False
    kinds = {type(x) for x in p}
    return len(kinds) != 1 or (list in kinds and any(not x for x in p))


_GUIDED = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _num_guided(r) -> int:
    rf = r.response_format
    return sum(getattr(r, f) is not None for f in _GUIDED[1:]) + (rf is not None and rf.type != "text")


def _tool_choice_name(r) -> str | None:
    return r.tool_choice.function.name if isinstance(r.tool_choice, NamedToolChoice) else None


def _forces_tools(r) -> bool:
    return r.tool_choice == "required" or _tool_choice_name(r) is not None


_COMMON_RULES: list[Rule] = [
    ("response_format", lambda r: _num_guided(r) > 1,
     "give only one of response_format, guided_json, guided_regex, guided_choice and guided_grammar"),
    ("response_format", lambda r: r.response_format is not None and r.response_format.type == "json_schema"
     and (r.response_format.json_schema is None or r.response_format.json_schema.schema is None),
     "response_format of type json_schema needs json_schema.schema"),
    ("stream_options", lambda r: r.stream_options is not None and not r.stream,
     "stream_options is only allowed when stream is true"),
    ("kv_transfer", lambda r: r.kv_transfer is not None and _kv_transfer_bad(r) is not None,
     "kv_transfer: one choice only (n = 1, no best_of or beam search), and either export (not streamed) or a "
     "handle with forced_token_ids"),
]
_COMPLETION_RULES: list[Rule] = [
    ("prompt", lambda r: r.prompt == "" or r.prompt == [], "prompt must not be empty"),
    ("prompt", _prompt_kind_mixed,
     "prompt must be a string, a list of strings, a list of token ids or a list of non-empty token-id lists"),
    ("suffix", lambda r: bool(r.suffix), "suffix is not supported"),
    ("best_of", lambda r: r.best_of is not None and r.best_of > (r.n or 1) and bool(r.stream) and not r.use_beam_search,
     "best_of greater than n cannot be streamed: the best choices are known only at the end"),
    ("use_beam_search", lambda r: r.use_beam_search and _num_guided(r) > 0,
     "structured output (response_format, guided_*) is not supported with use_beam_search"),
]
_CHAT_PARTS: Rule = (  # images in: image_url parts, each with its URL (media.py reads them)
    "messages", lambda r: any(p.type not in ("text", "image_url") or (p.type == "image_url" and not p.image_url)
                              for m in r.messages if isinstance(m.content, list) for p in m.content),
    "content parts are text or image_url (with image_url.url) only")
_CHAT_RULES: list[Rule] = [
    ("top_logprobs", lambda r: r.top_logprobs is not None and not r.logprobs,
     "top_logprobs requires logprobs to be true"),
    _CHAT_PARTS,
    ("tool_choice", lambda r: _forces_tools(r) and not r.tools,
     "tool_choice required or a named function needs tools"),
    ("tool_choice", lambda r: _tool_choice_name(r) is not None
     and _tool_choice_name(r) not in {t.function.name for t in r.tools or []},
     "tool_choice names a function that is not in tools"),
    ("tool_choice", lambda r: _forces_tools(r) and _num_guided(r) > 0,
     "tool_choice required or a named function cannot be combined with response_format or guided_*"),
    ("tools", lambda r: r.tools is not None and len({t.function.name for t in r.tools}) != len(r.tools),
     "tool function names must be unique"),
]
_TOKENIZE_CHAT_RULES: list[Rule] = [
    ("continue_final_message", lambda r: r.continue_final_message, "continue_final_message is not supported"),
    _CHAT_PARTS,
]
_RULES = {CompletionRequest: _COMMON_RULES + _COMPLETION_RULES, ChatCompletionRequest: _COMMON_RULES + _CHAT_RULES,
          TokenizeCompletionRequest: [], TokenizeChatRequest: _TOKENIZE_CHAT_RULES, DetokenizeBody: []}

_PATH = re.compile(r"at `\$\.([^`]+)`")
_MISSING = re.compile(r"missing required field `([^`]+)`")


def parse(body: bytes, kind: type[msgspec.Struct]):
    """Decode and validate a request body, or raise ``ApiError`` (400) naming the bad field."""
    try:
        req = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise ApiError(f"invalid request: {exc}", param=_param_of(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise ApiError(f"the request body is not valid JSON: {exc}") from None
    for param, is_bad, message in _RULES.get(kind, ()):
        if is_bad(req):
            raise ApiError(message, param=param)
    return req


def _param_of(message: str) -> str | None:
    at, missing = _PATH.search(message), _MISSING.search(message)
    parts = [m.group(1) for m in (at, missing) if m is not None]
    if not parts:
        return None
    return re.sub(r"\[\d+\]", "", ".".join(parts))  # "messages[0].role" -> "messages.role"


class LoadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    """vLLM's ``/v1/load_lora_adapter`` body."""

    lora_name: Annotated[str, Meta(min_length=1)]
    lora_path: Annotated[str, Meta(min_length=1)]


class UnloadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    """vLLM's ``/v1/unload_lora_adapter`` body (``lora_int_id`` is accepted and ignored)."""

    lora_name: Annotated[str, Meta(min_length=1)]
    lora_int_id: int | None = None
