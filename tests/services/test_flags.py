"""Flags are declared once, on the config fields (``shared/config.py``), and every parser and the
launcher's forwarding come from those declarations (``shared/flags.py``)."""

from __future__ import annotations

import argparse
import dataclasses
from collections import Counter

import pytest

from folio.services.serve import SERVICES, add_serve_args, service_argv
from folio.shared.config import GatewayConfig, RouterConfig, RuntimeConfig, SchedulerConfig, TokenizerConfig
from folio.shared.flags import SERVICE_CONFIGS, config_values, declared, flags_for, service_parser


def test_each_flag_is_declared_once():
    names = Counter(d.flag.name for d in declared())
    assert names["--max-num-seqs"] == 1 and names["--max-model-len"] == 1 and names["--max-num-batched-tokens"] == 1
    assert [n for n, count in names.items() if count > 1] == []
    # the fields the scheduler's flags fill in other configs, by name
    assert {"max_num_seqs", "max_num_batched_tokens"} <= {f.name for f in dataclasses.fields(RuntimeConfig)}
    assert "max_model_len" in {f.name for f in dataclasses.fields(TokenizerConfig)}


def test_router_policies_match_the_routing_module():
    from folio.services.router.routing import POLICIES

    (policy,) = [d for d in declared() if d.flag.name == "--policy"]
    assert tuple(policy.flag.choices) == POLICIES


def test_each_service_defaults_to_its_own_config():
    assert service_parser("gateway", "").parse_args([]).port == GatewayConfig.port == 8000
    assert service_parser("router", "").parse_args(["--replica", "http://x"]).port == RouterConfig.port == 8080
    args = service_parser("scheduler", "").parse_args([])
    assert SchedulerConfig(endpoints=None, **config_values(SchedulerConfig, args, "scheduler")) == \
        SchedulerConfig(endpoints=None)


def _other_value(d):
    """A value for the flag that is not its default, as a command-line string (None: an on/off flag)."""
    if d.flag.choices:
        return str(next(c for c in d.flag.choices if c != d.default))
    if d.annotation.startswith("bool"):
        return None
    if d.annotation.startswith("float"):
        return "0.375"
    if d.annotation.startswith("int"):
        return "7"
    return f"value-of-{d.flag.dest}"


def test_serve_forwards_every_flag_to_the_services_that_take_it(monkeypatch):
    """Each flag a launched service takes, given to ``folio serve`` with a non-default value,
    reaches that service's config (or its parsed flags) with that value."""
    monkeypatch.delenv("FOLIO_API_KEY", raising=False)
    monkeypatch.delenv("FOLIO_LOG_JSON", raising=False)
    argv, expected = [], {}
    for d in declared():
        if not set(d.flag.services) & set(SERVICES):
            continue
        value = _other_value(d)
        if value is None:
            on = not d.default
            argv.append(d.flag.name if on else f"--no-{d.flag.name[2:]}")
            expected[d.flag.dest] = on
        else:
            argv += [d.flag.name, value]
            expected[d.flag.dest] = value
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(argv)
    for name in SERVICES:
        got = service_parser(name, "").parse_args(service_argv(name, args, "/resolved/model"))
        for d in flags_for(name):
            want = expected[d.flag.dest]
            if d.flag.dest == "model":
                want = "/resolved/model"
            if not d.flag.forward:  # the API key travels in the environment, never in argv
                assert getattr(got, d.flag.dest) is None and want not in service_argv(name, args, "")
                continue
            assert str(getattr(got, d.flag.dest)) == str(want), (name, d.flag.name)
        config = SERVICE_CONFIGS[name]
        values = config_values(config, got, name)
        assert values and all(getattr(got, d.flag.dest) == values[d.field] for d in flags_for(name)
                              if d.field in values and d.flag.forward)


def test_a_flag_no_service_of_serve_takes_is_refused_by_serve():
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--replica-dns", "x:1"])
