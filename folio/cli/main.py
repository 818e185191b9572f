"""``folio``: one command for people and containers.

More in docs/modules.md (folio/cli/main.py).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from folio.shared import curve
from folio.shared.transport import ask_service
from folio.shared.config import DEFAULT_PORT, Endpoints, RouterConfig, default_run_dir, keys_dir_from_env
from folio.shared.keys import KeysError, init_keys

RUNNABLE = ("gateway", "tokenizer", "scheduler", "kvmanager", "executor", "router")
# admin verbs per service as the CLI names it ("kv" is the kvmanager); more come with later issues
ADMIN_VERBS = {
    "kv": ("kvmanager", ("stats", "seq", "blocks", "clear")),
    "scheduler": ("scheduler", ("stats", "requests", "abort", "drain", "resume")),
    "executor": ("executor", ("stats",)),
    "tokenizer": ("tokenizer", ("stats",)),
    "gateway": ("gateway", ("stats",)),
    "router": ("router", ("stats", "replicas")),
}
_NEEDS_REQ_ID = {"seq", "abort"}


def build_parser() -> argparse.ArgumentParser:
    from folio.services.serve import add_serve_args

    parser = argparse.ArgumentParser(prog="folio", description="serve LLMs with a paged KV cache and continuous batching")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_args(sub.add_parser("serve", help="start the five services and the HTTP API"))
    run = sub.add_parser("run", help="run one service alone", add_help=False)
    run.add_argument("service", choices=RUNNABLE)
    sub.add_parser("quantize", help="write a quantized model folder (awq, int4, int8)", add_help=False)
    sub.add_parser("chat", help="talk to a model in the terminal (any OpenAI-compatible URL)", add_help=False)
    sub.add_parser("train-draft", help="train an eagle3 draft head for a model on its own answers", add_help=False)
    sub.add_parser("bench", help="benchmarks: serve (any OpenAI-compatible endpoint), list, NAME", add_help=False)
    prepare = sub.add_parser("prepare", help="prepare the packaged default model")
    prepare.add_argument("--force", action="store_true")
    for cli_name, (service, verbs) in ADMIN_VERBS.items():
        admin = sub.add_parser(cli_name, help=f"ask the {service}: {', '.join(verbs)}")
        admin.add_argument("verb", choices=verbs)
        admin.add_argument("req_id", nargs="?", help=f"for {', '.join(sorted(_NEEDS_REQ_ID & set(verbs))) or '-'}")
        _add_admin_flags(admin)
    keys = sub.add_parser("keys", help="the internal plane's keys: init DIR, split DIR OUT --service NAME")
    keys.add_argument("verb", choices=("init", "split"))
    keys.add_argument("folder", metavar="DIR")
    keys.add_argument("out", nargs="?", metavar="OUT", help="split: the reduced folder to write")
    keys.add_argument("--peer", action="append", default=[], metavar="NAME",
                      help="init: also a key pair of its own for instance NAME (repeatable; it presents it with "
                           "FOLIO_PEER_KEY=NAME; a KV transfer is served only to the key its handle names); "
                           "split: also copy that pair")
    keys.add_argument("--service", action="append", default=[], choices=RUNNABLE, metavar="NAME",
                      help="split: the service whose secret OUT gets (repeatable: a `folio serve` container "
                           "runs five)")
    health = sub.add_parser("health", help="exit 0 when SERVICE answers on its admin socket")
    health.add_argument("service", choices=RUNNABLE)
    health.add_argument("--http", default=None, metavar="URL",
                        help="ask this /health URL instead (200: every service answers)")
    _add_admin_flags(health)
    return parser


def _add_admin_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the reply's data as JSON")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--run-dir", default=None, help="the serve run folder (default: from the environment)")
    where.add_argument("--port", type=int, default=None, help="the HTTP port of the server to ask")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the reply")
    parser.add_argument("--keys-dir", default=None, metavar="DIR",
                        help="the stack's key folder, for tcp endpoints (default: $FOLIO_KEYS_DIR)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    # `run` hands every flag after the service name to that service's own parser
    if len(argv) >= 2 and argv[0] == "run" and argv[1] in RUNNABLE:
        return run_service(argv[1], argv[2:])
    if argv and argv[0] == "quantize":  # its own parser, as for run
        from folio.cli.quantize import main as quantize_main

        return quantize_main(argv[1:])
    if argv and argv[0] == "train-draft":
        from folio.cli.train_draft import main as train_draft_main

        return train_draft_main(argv[1:])
    if argv and argv[0] == "chat":
        from folio.cli.chat import main as chat_main

        return chat_main(argv[1:])
    if argv and argv[0] == "bench":  # its own parsers: serve's, and each script's
        from folio.cli.bench import main as bench_main

        return bench_main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "serve":
        from folio.services.serve import serve

        return serve(args)
    if args.command == "run":
        parser.error(f"run needs a service: {', '.join(RUNNABLE)}")
    if args.command == "prepare":
        from folio.core.model_files import main as prepare_main

        return prepare_main(["--force"] if args.force else [])
    if args.command == "keys" and args.verb == "split":
        return keys_split(args.folder, args.out, args.service, args.peer)
    if args.command == "keys":
        return keys_init(args.folder, args.peer)
    if args.command != "health" or not args.http:  # a tcp endpoint is spoken to with the stack's keys only
        try:
            curve.use_keys(args.keys_dir or keys_dir_from_env())
        except KeysError as exc:
            print(f"folio: {exc}", file=sys.stderr)
            return 1
    if args.command == "health":
        if args.http:
            return http_health(args.http, args.timeout)
        try:
            reply = ask_service(_endpoints(args, args.service), args.service, "ping", {}, args.timeout)
        except (curve.MissingKeys, KeysError) as exc:
            print(f"folio: {exc}", file=sys.stderr)
            return 1
        return 0 if reply is not None else 1
    service, _ = ADMIN_VERBS[args.command]
    return admin_command(args, service)


def keys_init(folder: str, peers: list[str] = ()) -> int:
    from folio.shared.keys import init_peer

    try:
        keys = init_keys(folder)
        made = {name: init_peer(folder, name) for name in peers}
    except (OSError, KeysError) as exc:
        print(f"folio: {exc}", file=sys.stderr)
        return 1
    print(f"folio: keys in {folder} (client {keys.client_public.decode()}; a server key for each of "
          f"{', '.join(keys.services)})")
    for name, public in made.items():
        print(f"folio: peer {name} {public.decode()} (FOLIO_PEER_KEY={name})")
    return 0


def keys_split(folder: str, out: str | None, services: list[str], peers: list[str] = ()) -> int:
    from folio.shared.keys import split_keys

    if not out or not services:
        print("folio: keys split needs DIR OUT and at least one --service NAME", file=sys.stderr)
        return 2
    try:
        split_keys(folder, out, services, peers)
    except (OSError, KeysError) as exc:
        print(f"folio: {exc}", file=sys.stderr)
        return 1
    print(f"folio: keys for {', '.join(services)} in {out}")
    return 0


def run_service(name: str, argv: list[str]) -> int:
    module = importlib.import_module(f"folio.services.{name}.main")
    return module.main(argv) or 0


def _endpoints(args: argparse.Namespace, service: str) -> Endpoints:
    if args.run_dir:
        return Endpoints.ipc(args.run_dir)
    if args.port is not None:
        return Endpoints.ipc(default_run_dir(args.port))
    # the service's own default port: a router alone listens on 8080, and its folder is that port's
    return Endpoints.from_env(RouterConfig.port if service == "router" else DEFAULT_PORT)


def http_health(url: str, timeout_s: float) -> int:
    """0 when ``url`` answers 200; else 1, printing what it said (the services that are down)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout_s):
            return 0
    except urllib.error.HTTPError as exc:
        print(f"folio: {url}: {exc.code} {exc.read().decode(errors='replace')[:500]}", file=sys.stderr)
    except OSError as exc:
        print(f"folio: {url}: {exc}", file=sys.stderr)
    return 1


def admin_command(args: argparse.Namespace, service: str) -> int:
    call_args = {}
    if args.verb in _NEEDS_REQ_ID:
        if not args.req_id:
            print(f"folio: {args.verb} needs a request id", file=sys.stderr)
            return 2
        call_args["req_id"] = args.req_id
    try:
        reply = ask_service(_endpoints(args, service), service, args.verb, call_args, args.timeout)
    except (curve.MissingKeys, KeysError) as exc:
        print(f"folio: {exc}", file=sys.stderr)
        return 1
    if reply is None:
        print(f"folio: the {service} did not answer within {args.timeout:g}s (is it running? --port? --run-dir?)",
              file=sys.stderr)
        return 1
    if not reply.ok:
        print(f"folio: {service}: {reply.error}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(reply.data, indent=2, sort_keys=True))
    else:
        print_table(reply.data)
    return 0


def print_table(data: dict, indent: str = "") -> None:
    width = max((len(k) for k in data), default=0)
    for key, value in data.items():
        if isinstance(value, list) and value and isinstance(value[0], str):  # a block map: one row a line
            print(f"{indent}{key}:")
            for row in value:
                print(f"{indent}  {row}")
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            print(f"{indent}{key}:")
            for item in value:
                print(f"{indent}  - " + "  ".join(f"{k}={v}" for k, v in item.items()))
        elif isinstance(value, dict) and value:  # e.g. the kvmanager's tiers: one indented block each
            print(f"{indent}{key}:")
            print_table(value, indent + "  ")
        elif isinstance(value, float):
            print(f"{indent}{key:<{width}}  {value:.4g}")
        else:
            print(f"{indent}{key:<{width}}  {value}")


if __name__ == "__main__":
    sys.exit(main())
