"""Every message type's msgpack decoding, fed hostile bytes: a clear ``MalformedMessage`` (which the
socket loops log and drop), never another exception.

For the tagged types of ``folio.shared.messages``: random bytes, msgpack maps that carry a type's
own tag with random fields and values, and such maps cut short (the bytes an authenticated but
broken or hostile peer would send), decoded by the same ``Decoder`` the services use: 1,000
hypothesis cases over all types, and 1,000 seeded cases for each type.
"""

from __future__ import annotations

import inspect
import random

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from folio.shared import messages
from folio.shared.transport import Decoder, MalformedMessage

TAGGED = sorted((cls for _, cls in inspect.getmembers(messages, inspect.isclass)
                 if issubclass(cls, msgspec.Struct) and cls.__module__ == messages.__name__
                 and cls.__struct_config__.tag is not None), key=lambda c: c.__name__)

_scalars = st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=8) | \
    st.binary(max_size=8)
_values = _scalars | st.lists(_scalars, max_size=4) | st.dictionaries(st.text(max_size=4), _scalars, max_size=3)


def _maps(cls):
    fields = list(cls.__struct_fields__) + ["type", "x"]
    return st.dictionaries(st.sampled_from(fields), _values, max_size=len(fields)).map(
        lambda d: msgspec.msgpack.encode({**d, "type": cls.__struct_config__.tag}))


def test_every_message_type_is_fuzzed():
    assert len(TAGGED) >= 30 and messages.StepPlan in TAGGED and messages.AdminRequest in TAGGED


DECODERS = {cls: Decoder(cls) for cls in TAGGED}


def _decode(cls, data: bytes) -> None:
    try:
        DECODERS[cls].decode(data)
    except MalformedMessage:
        pass  # what the loops log and drop


@pytest.mark.slow  # 1,000 hypothesis cases: 5-11 s measured here
@settings(max_examples=1000, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(TAGGED).flatmap(lambda cls: st.tuples(st.just(cls), st.binary(max_size=64) | _maps(cls))))
def test_hostile_bytes_are_a_clear_drop(case):
    """Hypothesis picks the type and the bytes (and shrinks a failure to its smallest case)."""
    _decode(*case)


def _random_case(rng: random.Random, cls) -> bytes:
    """Random bytes, a valid-looking map of the type's fields with random values, or one cut short."""
    roll = rng.random()
    if roll < 0.3:
        return rng.randbytes(rng.randrange(64))
    pool = [None, True, -1, 2**64 - 1, -2**63, 1.5, float("nan"), "x" * rng.randrange(9), b"\x00", [1, "a"],
            {"k": 1}, [[]], {}]
    fields = list(cls.__struct_fields__)
    body = {f: rng.choice(pool) for f in rng.sample(fields, rng.randrange(len(fields) + 1))}
    data = msgspec.msgpack.encode({**body, "type": cls.__struct_config__.tag})
    return data[:rng.randrange(len(data))] if roll > 0.85 else data


@pytest.mark.parametrize("cls", TAGGED, ids=lambda c: c.__name__)
def test_a_thousand_cases_a_type(cls):
    """1,000 seeded cases for each type (cheap, so that every type gets them in the fast tier)."""
    rng = random.Random(cls.__name__)
    for _ in range(1000):
        _decode(cls, _random_case(rng, cls))
