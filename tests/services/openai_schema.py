"""Validate gateway responses against the OpenAI OpenAPI description (``tests/data/openai-openapi.yaml``).

The description mixes OpenAPI 3.0's ``nullable: true`` into 3.1 schemas; jsonschema ignores that
keyword, so it is rewritten into ``anyOf [..., null]`` once at load.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import jsonschema
import yaml

SPEC = Path(__file__).resolve().parents[1] / "data" / "openai-openapi.yaml"  # vendored (tests/data/README.md)


def _nullable(node):
    if isinstance(node, dict):
        node = {k: _nullable(v) for k, v in node.items()}
        if node.pop("nullable", False) is True:
            return {"anyOf": [node, {"type": "null"}]}
        return node
    if isinstance(node, list):
        return [_nullable(v) for v in node]
    return node


@lru_cache(maxsize=1)
def _components() -> dict:
    spec = yaml.load(SPEC.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    return _nullable(spec["components"])


def validate(instance: dict, schema_name: str) -> None:
    """Raise ``jsonschema.ValidationError`` unless ``instance`` fits ``#/components/schemas/<name>``."""
    schema = {"$ref": f"#/components/schemas/{schema_name}", "components": _components()}
    jsonschema.validate(instance, schema, cls=jsonschema.Draft202012Validator)
