"""Tool calls read out of a model's free text, in the format each model family writes them.

``structured.ToolCallReader`` (chat, and through it the Responses and Messages APIs) asks
``parse_calls(text, names, parser)`` for a choice's (content, tool calls) once the text is whole,
and ``hold_from`` which part of streamed text may still become a call (held back, not sent as
content). ``parser`` is ``--tool-call-parser``: one format, or ``auto``, which reads whichever of
them the text is written in (the markers do not overlap), so every family works without a flag.

More in docs/modules.md (services/gateway/tool_parsers.py).
"""

from __future__ import annotations

import ast
import json
import re
import uuid

PARSERS = ("auto", "hermes", "llama3_json", "pythonic", "mistral", "qwen3_coder")


def tool_call(name: str, arguments) -> dict:
    """An OpenAI ``tool_calls`` item; ``arguments`` as JSON text."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


# --------------------------------------------------------------------------- one parser per format
# each: (text, names) -> (content, calls), or None when the text holds no well-formed call in it


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def _hermes(text: str, names: set[str]):
    if "<tool_call>" not in text:
        return None
    calls = [_json_call(body, names) for body in _HERMES.findall(text)]
    if not calls or any(c is None for c in calls):
        return None
    return text[: text.index("<tool_call>")].strip() or None, calls


def _llama3_json(text: str, names: set[str]):
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return None
    try:
        json.loads(body)
        parts = [body]
    except ValueError:
        parts = [p for p in body.split(";") if p.strip()]
    calls = [_json_call(part, names) for part in parts]
    if not calls or any(c is None for c in calls):
        return None
    return None, calls


def _pythonic(text: str, names: set[str]):
    body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
    if not (body.startswith("[") and body.endswith("]")):
        return None
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names
                and not node.args):
            return None
        try:  # literals only: nothing of the text is ever evaluated
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        except ValueError:
            return None
        calls.append(tool_call(node.func.id, args))
    return None, calls


_MISTRAL_NEW = re.compile(r"\[TOOL_CALLS\]\s*([A-Za-z0-9_.-]+)\s*\[ARGS\]")


def _mistral(text: str, names: set[str]):
    stripped = text.strip()
    if "[TOOL_CALLS]" not in stripped:
        # the marker is a special token: a decode that skips them leaves the bare JSON list
        return _json_list(stripped, names) if stripped.startswith("[{") else None
    content = stripped[: stripped.index("[TOOL_CALLS]")].strip() or None
    new = list(_MISTRAL_NEW.finditer(stripped))
    if new:  # [TOOL_CALLS]name[ARGS]{...} (v11+ tokenizers), maybe several
        calls = []
        for i, m in enumerate(new):
            end = new[i + 1].start() if i + 1 < len(new) else len(stripped)
            try:
                args = json.loads(stripped[m.end():end])
            except ValueError:
                return None
            if m.group(1) not in names:
                return None
            calls.append(tool_call(m.group(1), args))
        return content, calls
    found = _json_list(stripped[stripped.index("[TOOL_CALLS]") + len("[TOOL_CALLS]"):].strip(), names)
    return None if found is None else (content, found[1])


def _json_list(body: str, names: set[str]):
    try:
        items = json.loads(body)
    except ValueError:
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = [_json_call(json.dumps(i), names) for i in items]
    return None if any(c is None for c in calls) else (None, calls)


_CODER_CALL = re.compile(r"<tool_call>\s*<function=([^>\s]+)>(.*?)</function>\s*(?:</tool_call>|$)", re.S)
_CODER_PARAM = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.S)


def _qwen3_coder(text: str, names: set[str], schemas: dict[str, dict] | None = None):
    if "<function=" not in text or "<tool_call>" not in text:
        return None
    calls = []
    for name, body in _CODER_CALL.findall(text):
        if name not in names:
            return None
        props = ((schemas or {}).get(name) or {}).get("properties", {})
        args = {key: _coder_value(value, props.get(key, {})) for key, value in _CODER_PARAM.findall(body)}
        calls.append(tool_call(name, args))
    if not calls:
        return None
    return text[: text.index("<tool_call>")].strip() or None, calls


def _coder_value(value: str, schema: dict):
    """A parameter's text as its schema's type: strings stay text, the rest is read as JSON."""
    if schema.get("type") == "string":
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def _json_call(body: str, names: set[str]) -> dict | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    return tool_call(obj["name"], obj.get("arguments", obj.get("parameters", {})))


_BY_NAME = {"hermes": _hermes, "llama3_json": _llama3_json, "pythonic": _pythonic, "mistral": _mistral,
            "qwen3_coder": _qwen3_coder}
# auto: Qwen3-Coder before Hermes (both open with <tool_call>), the bracketed forms before bare JSON
_AUTO_ORDER = ("qwen3_coder", "hermes", "mistral", "pythonic", "llama3_json")


def parse_calls(text: str, names: set[str], parser: str = "auto",
                schemas: dict[str, dict] | None = None) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a whole text; text that holds no well-formed call is all content.
    ``schemas``: each tool's parameter schema (Qwen3-Coder's values are typed by it)."""
    for name in (_AUTO_ORDER if parser == "auto" else (parser,)):
        found = _qwen3_coder(text, names, schemas) if name == "qwen3_coder" else _BY_NAME[name](text, names)
        if found is not None:
            return found
    return text, []


_MARKERS = {"hermes": ("<tool_call>",), "qwen3_coder": ("<tool_call>",), "llama3_json": ("<|python_tag|>",),
            "pythonic": ("<|python_start|>",), "mistral": ("[TOOL_CALLS]",)}
_OPENERS = {"llama3_json": "{", "pythonic": "[", "mistral": "["}  # a call that opens the reply bare


def hold_from(text: str, at_start: bool, parser: str = "auto") -> int:
    """Where the part of streamed ``text`` that may still become a tool call begins (``len(text)``:
    none of it): at a marker (or the start of one cut by the delta's end), or at the reply's start
    when it opens with a bare call's first character."""
    parsers = _AUTO_ORDER if parser == "auto" else (parser,)
    openers = tuple(_OPENERS[p] for p in parsers if p in _OPENERS)
    if at_start and (not text.strip() or (openers and text.lstrip().startswith(openers))):
        return 0
    markers = tuple({m for p in parsers for m in _MARKERS[p]})
    for i, ch in enumerate(text):
        if ch in "<[" and any(m.startswith(text[i:i + len(m)]) for m in markers):
            return i
    return len(text)
