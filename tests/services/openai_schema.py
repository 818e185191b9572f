"""Validate gateway responses against the OpenAI OpenAPI description (``shared/reference``).

The description mixes OpenAPI 3.0's ``nullable: true`` into 3.1 schemas; jsonschema ignores that
keyword, so it is rewritten into ``anyOf [..., null]`` once at load.
"""

from __future__ import annotations

import warnings
from functools import lru_cache
from pathlib import Path

import jsonschema
import yaml

_ROOT = Path(__file__).resolve().parents[2]
# the description sits next to the checkout in the workspace; without it only the schema checks
# are left out (with a warning), the tests' own assertions still run
_CANDIDATES = [_ROOT.parent / "shared" / "reference" / "openai-openapi.yaml",
               _ROOT / "shared" / "reference" / "openai-openapi.yaml"]
SPEC = next((p for p in _CANDIDATES if p.exists()), None)


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
    if SPEC is None:
        warnings.warn("the OpenAI OpenAPI description is not beside this checkout: schema check left out")
        return
    schema = {"$ref": f"#/components/schemas/{schema_name}", "components": _components()}
    jsonschema.validate(instance, schema, cls=jsonschema.Draft202012Validator)
