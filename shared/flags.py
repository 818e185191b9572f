"""Command-line parsers, generated from the flags declared on the config fields (``shared/config.py``).

- ``service_parser(service)``: what ``folio run SERVICE`` takes (each service's ``main.py``);
- ``config_values(cls, args, service)``: a config's fields from the parsed flags;
- ``add_launcher_flags(parser)`` and ``forwarded_argv(service, args)``: ``folio serve`` takes every
  flag of the services it starts and hands each service the ones it takes, only those given.

A flag is declared once, on one field (``max_num_seqs`` on ``SchedulerConfig``); a service whose
config has a field of the same name (the executor's ``RuntimeConfig.max_num_seqs``) gets its value.
A service's parser defaults to its own config's default for that field (``--port``: 8000 on the
gateway, 8080 on the router).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from functools import cache

from folio.shared.config import (
    LAUNCHED,
    Flag,
    GatewayConfig,
    KVManagerConfig,
    LogConfig,
    PlaneConfig,
    RouterConfig,
    RuntimeConfig,
    SchedulerConfig,
    TokenizerConfig,
)

# the config each service builds from its flags (the executor's: its runtime's)
SERVICE_CONFIGS = {"kvmanager": KVManagerConfig, "executor": RuntimeConfig, "scheduler": SchedulerConfig,
                   "tokenizer": TokenizerConfig, "gateway": GatewayConfig, "router": RouterConfig}
_DECLARING = (LogConfig, PlaneConfig, RuntimeConfig, KVManagerConfig, SchedulerConfig, TokenizerConfig, GatewayConfig, RouterConfig)
_TYPES = {"int": int, "float": float, "str": str}


@dataclasses.dataclass(frozen=True)
class Declared:
    flag: Flag
    field: str  # the field it is declared on (and fills by name in other configs)
    default: object  # that field's default
    annotation: str


@cache
def declared() -> tuple[Declared, ...]:
    """Every flag, in declaration order; a service never gets two flags of one name or field."""
    out = []
    for cls in _DECLARING:
        for f in dataclasses.fields(cls):
            flag = f.metadata.get("flag")
            if flag is not None:
                flag = dataclasses.replace(flag, name=flag.name or f"--{f.name.replace('_', '-')}")
                out.append(Declared(flag, f.name, f.default, str(f.type)))
    for service in SERVICE_CONFIGS:
        mine = [d for d in out if service in d.flag.services]
        for what in ("name", "field"):
            keys = [d.flag.name if what == "name" else d.field for d in mine]
            assert len(keys) == len(set(keys)), f"{service}: a flag {what} declared twice: {sorted(keys)}"
    return tuple(out)


def flags_for(service: str) -> list[Declared]:
    return [d for d in declared() if service in d.flag.services]


def _default_for(d: Declared, service: str):
    """The service's own config default for the field, else the declaring field's."""
    fields = {f.name: f for f in dataclasses.fields(SERVICE_CONFIGS[service])}
    own = fields.get(d.field)
    return own.default if own is not None and own.default is not dataclasses.MISSING else d.default


class ArgList(tuple):
    """The values of an ``extend`` flag (``--lora-modules A=x B=y``); ``str()`` spells them as on a
    command line."""

    def __str__(self) -> str:
        return shlex.join(self)


class _Extend(argparse.Action):
    """One or more values per use, repeatable: every value given, in order, as an ``ArgList``."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, ArgList((*(getattr(namespace, self.dest) or ()), *values)))


def _add(parser: argparse.ArgumentParser, d: Declared, default) -> None:
    flag = d.flag
    kw: dict = {"dest": flag.dest, "default": default, "help": flag.help}
    if flag.metavar:
        kw["metavar"] = flag.metavar
    if flag.action == "store_true":
        kw["action"] = "store_true"
    elif flag.action == "extend":
        kw.update(action=_Extend, nargs="+", default=ArgList(default) if default is not None else None)
    elif flag.action == "append":
        kw.update(action="append", default=list(default) if default is not None else None)
    elif d.annotation.startswith("bool"):
        kw["action"] = argparse.BooleanOptionalAction
    else:
        kw["type"] = flag.type or _TYPES[d.annotation.split("|")[0].split("[")[0].strip()]
        if flag.choices:
            kw["choices"] = list(flag.choices)
    parser.add_argument(flag.name, *flag.aliases, **kw)


def service_parser(service: str, description: str) -> argparse.ArgumentParser:
    """``folio run SERVICE``'s parser: every flag the service takes, with its defaults."""
    parser = argparse.ArgumentParser(prog=f"folio run {service}", description=description)
    for d in flags_for(service):
        _add(parser, d, _default_for(d, service))
    return parser


def config_values(cls, args: argparse.Namespace, service: str) -> dict:
    """The fields of ``cls`` that ``service``'s flags set, from ``args`` (with the environment's
    fallbacks, e.g. ``$FOLIO_API_KEY``); repeated flags become tuples."""
    by_field = {d.field: d for d in flags_for(service)}
    values = {}
    for f in dataclasses.fields(cls):
        d = by_field.get(f.name)
        if d is None:
            continue
        value = getattr(args, d.flag.dest)
        if d.flag.env is not None and not value:
            value = d.flag.env() or value
        values[f.name] = tuple(value) if isinstance(value, list) else value
    return values


def add_launcher_flags(parser: argparse.ArgumentParser) -> None:
    """Every flag of the services ``folio serve`` starts. They default to None (not forwarded: the
    service's own default holds), except those the launcher reads itself (``--model``, ``--port``)."""
    for d in declared():
        if set(d.flag.services) & set(LAUNCHED):
            service = next(s for s in d.flag.services if s in LAUNCHED)
            _add(parser, d, _default_for(d, service) if d.flag.launcher_default else None)


def forwarded_argv(service: str, args: argparse.Namespace) -> list[str]:
    """The flags ``folio run SERVICE`` gets from ``folio serve``: those it takes that were given."""
    argv: list[str] = []
    for d in flags_for(service):
        value = getattr(args, d.flag.dest, None)
        if value is None or not d.flag.forward:
            continue
        if isinstance(value, bool):  # an on/off flag: --x or --no-x (a store_true one is only ever --x)
            if value or d.flag.action != "store_true":
                argv.append(d.flag.name if value else f"--no-{d.flag.name[2:]}")
        elif isinstance(value, (list, tuple)):
            for item in value:
                argv += [d.flag.name, str(item)]
        else:
            argv += [d.flag.name, str(value)]
    return argv
