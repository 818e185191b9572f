"""``folio run router``: parse flags into ``RouterConfig`` and route HTTP until SIGTERM/SIGINT.

Its admin socket comes from the environment (``folio.shared.config.Endpoints.from_env``), as for every
service (without ``FOLIO_RUN_DIR``: the run folder of its ``--port``); the replicas come from
``--replica`` (repeatable) and ``--replica-dns``, or, disaggregated, from ``--prefill`` and
``--decode`` (``disagg.py``). Its keys are ``--keys-dir``'s, else this host's (made if missing).
"""

from __future__ import annotations

import sys

from folio.shared.config import RouterConfig
from folio.services.shell import ServiceSpec, StartError


def check(parser, args) -> None:
    from folio.services.router.replicas import parse_replica

    if bool(args.prefill) != bool(args.decode):
        parser.error("disaggregated serving needs both --prefill and --decode instances")
    if not args.replica and not args.replica_dns and not args.prefill:
        parser.error("give at least one --replica URL or --replica-dns NAME:PORT (or --prefill and --decode URLs)")
    if args.replica_dns and not args.replica_dns.rpartition(":")[2].isdigit():
        parser.error(f"--replica-dns wants NAME:PORT, got {args.replica_dns!r}")
    if args.max_attempts < 1:
        parser.error("--max-attempts must be at least 1")
    for spec in [*args.replica, *args.prefill, *args.decode]:
        try:
            parse_replica(spec, args.kv_events_port, args.kv_snapshot_port)
        except ValueError as exc:
            parser.error(str(exc))


def host_keys(log) -> None:
    """With no key folder named, the one ``folio serve`` makes on this host, made here when this
    router starts first (as ``folio serve`` would make it): the replicas' KV events are on tcp,
    where every socket speaks CURVE, and a replica on this host finds the same folder."""
    from folio.shared import curve
    from folio.shared.config import default_keys_dir
    from folio.shared.keys import KeysError, init_keys

    if curve.curve_disabled() or curve.stack_keys() is not None:
        return
    folder = default_keys_dir()
    try:
        init_keys(folder)
    except (OSError, KeysError) as exc:
        raise StartError("no key folder for the replicas' KV events, and none can be made here; give --keys-dir",
                         keys_dir=str(folder), error=str(exc)) from exc
    curve.use_keys(str(folder), "router")
    log.info("no key folder given: using this host's", keys_dir=str(folder))


def open_service(config: RouterConfig, ctx, log):
    from folio.services.router.prompt import PromptEncoder
    from folio.services.router.service import RouterService

    host_keys(log)
    encoder = None
    if config.policy == "cache_aware":
        from folio.core.model_files import resolve_model
        from folio.core.tokenizer.text import TextTokenizer

        try:
            encoder = PromptEncoder(TextTokenizer(resolve_model(config.model)))
        except (FileNotFoundError, OSError, ValueError) as exc:
            raise StartError("cannot load the replicas' tokenizer; give --model", model=config.model,
                             error=str(exc)) from exc
    return RouterService(config, encoder, ctx)


SPEC = ServiceSpec("router", RouterConfig, __doc__.splitlines()[0], open_service, check=check, drop_unsent=True)

parse_config, main = SPEC.config, SPEC.main

if __name__ == "__main__":
    sys.exit(main())
