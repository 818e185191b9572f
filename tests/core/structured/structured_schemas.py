"""JSON schemas for the structured-output tests: nested objects, arrays with bounds, enums,
patterns, optional fields, ``$ref``/``$defs``, unions. Strings, integers and arrays are bounded
so that even a random-weight model, forced through the grammar, finishes every structure within
a small token budget."""

from __future__ import annotations

S = {"type": "string", "maxLength": 6}
I = {"type": "integer", "minimum": -50, "maximum": 50}


def obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


SCHEMAS: list[dict] = [
    obj({"name": S}),
    obj({"age": I}),
    obj({"ok": {"type": "boolean"}}),
    obj({"nothing": {"type": "null"}}),
    obj({"color": {"enum": ["red", "green", "blue"]}}),
    obj({"n": {"enum": [1, 2, 3, "many"]}}),
    obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    obj({"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2,3}$"}}),
    obj({"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}}),
    obj({"xs": {"type": "array", "items": I, "minItems": 2, "maxItems": 2}}),
    obj({"a": S, "b": I}, required=["a"]),
    obj({"a": S, "b": I, "c": {"type": "boolean"}}, required=[]),
    obj({"person": obj({"name": S, "age": I})}),
    obj({"outer": obj({"inner": obj({"leaf": {"type": "boolean"}})})}),
    obj({"people": {"type": "array", "items": obj({"name": S}), "minItems": 1, "maxItems": 2}}),
    obj({"matrix": {"type": "array", "items": {"type": "array", "items": I, "maxItems": 2}, "maxItems": 2}}),
    {"$defs": {"pt": obj({"x": I, "y": I})}, **obj({"p": {"$ref": "#/$defs/pt"}})},
    {"$defs": {"pt": obj({"x": I, "y": I})},
     **obj({"path": {"type": "array", "items": {"$ref": "#/$defs/pt"}, "minItems": 1, "maxItems": 2}})},
    {"$defs": {"name": S, "tag": {"enum": ["a", "b"]}}, **obj({"n": {"$ref": "#/$defs/name"},
                                                              "t": {"$ref": "#/$defs/tag"}})},
    obj({"v": {"anyOf": [I, {"type": "boolean"}]}}),
    obj({"v": {"oneOf": [obj({"kind": {"const": "a"}}), obj({"kind": {"const": "b"}, "n": I})]}}),
    obj({"const": {"const": "fixed"}}),
    obj({"maybe": {"type": ["string", "null"], "maxLength": 4}}),
    obj({"id": {"type": "string", "pattern": "^[a-f0-9]{4}$"}, "count": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}}),
    obj({"status": {"enum": ["ok", "fail"]}, "detail": S}, required=["status"]),
    obj({"items": {"type": "array", "items": obj({"sku": {"type": "string", "pattern": "^[0-9]{3}$"},
                                                   "qty": {"type": "integer", "minimum": 1, "maximum": 5}}),
                   "minItems": 1, "maxItems": 2}}),
    obj({"flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 0, "maxItems": 3}}),
    obj({"meta": obj({"version": {"type": "integer", "minimum": 1, "maximum": 3}, "beta": {"type": "boolean"}},
                     required=["version"])}),
    obj({"day": {"enum": ["mon", "tue", "wed"]}, "slots": {"type": "array", "items": {"type": "integer",
         "minimum": 8, "maximum": 18}, "minItems": 1, "maxItems": 2}}),
    obj({"first": S, "last": S, "email": {"type": "string", "pattern": "^[a-z]{1,4}@[a-z]{1,4}\\.com$"}}),
    {"type": "array", "items": I, "minItems": 1, "maxItems": 3},
    {"enum": ["alpha", "beta", "gamma"]},
]
