"""Schemathesis, a property-based API fuzzer, against a real ``folio serve``'s
``/v1/completions`` and ``/v1/chat/completions``, generating bodies from the OpenAI OpenAPI
description in tests/data (valid ones and, in its negative mode, invalid ones). No answer may
be a server error (5xx) and none may hang (each call has a 30 s deadline). A tiny random model
with a 48-token context keeps every valid request short; a few hundred examples run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import schemathesis
import yaml
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from folio.testing.faults import start_serve
from tests.services.openai_schema import SPEC

pytestmark = pytest.mark.slow  # a few hundred requests per route against a served stack

MAX_EXAMPLES = 150  # per operation
CALL_TIMEOUT_S = 30


def _operations() -> dict:
    """The description cut to the two POST operations folio serves (loading all of it takes long)."""
    spec = yaml.load(SPEC.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    paths = {p: {"post": spec["paths"][p]["post"]} for p in ("/completions", "/chat/completions")}
    return {"openapi": spec["openapi"], "info": spec["info"], "paths": paths, "components": spec["components"]}


schema = schemathesis.openapi.from_dict(_operations())


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory, smollm_tokenizer_dir):
    from folio.testing.models import write_tiny_chat_model

    model = write_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"), smollm_tokenizer_dir)
    srv = start_serve(model, "--num-kv-blocks", "512", "--max-model-len", "48", "--max-num-seqs", "256")
    srv.model_name = Path(model).name
    yield srv
    assert srv.stop() == 0, srv.stderr()[-3000:]


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_server_error_and_no_hang(case, fuzz_server):
    if isinstance(case.body, dict):
        # the description's model names are OpenAI's, and its prompt may be null (its default is a
        # special token): with those as they are nearly every body is refused before the engine
        case.body["model"] = fuzz_server.model_name
        if case.path == "/completions" and case.body.get("prompt") is None:
            case.body["prompt"] = "Hello"
    response = case.call(base_url=f"{fuzz_server.base}/v1", timeout=CALL_TIMEOUT_S)
    STATUSES[(case.path, response.status_code)] = STATUSES.get((case.path, response.status_code), 0) + 1
    case.validate_response(response, checks=[not_a_server_error])


STATUSES: dict[tuple[str, int], int] = {}  # what the fuzzer got, shown by the last test


def test_the_fuzzer_reached_the_engine():
    """Not only refusals: enough generated bodies were valid to run on the engine (200)."""
    if not STATUSES:
        pytest.skip("run with the fuzz test")
    print(sorted(STATUSES.items()))
    for path in ("/completions", "/chat/completions"):
        assert sum(n for (p, _), n in STATUSES.items() if p == path) >= 100, STATUSES
        assert STATUSES.get((path, 200), 0) >= 10, STATUSES
