"""The disagg deployments: compose.yaml's ``disagg`` profile and deploy/kubernetes/disagg.yaml put
one prefill and one decode instance behind the router, validated like the others (the Compose
schema, the Kubernetes schemas, and every command through its own parser)."""

from __future__ import annotations

import importlib
import urllib.parse
from pathlib import Path

import kubernetes_validate
import yaml

from folio.services.router.main import parse_config
from folio.services.router.replicas import parse_replica
from folio.shared.flags import service_parser
from tests.services.test_compose import COMPOSE, command_of, test_validates_against_the_compose_schema  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
K8S = [d for d in yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "disagg.yaml").read_text()) if d]


def _serve_args(cmd: list[str]):
    """``folio serve``'s flags as the executor and gateway parsers take them."""
    return cmd[cmd.index("--kv-role") + 1]


def test_the_disagg_profile_puts_a_prefill_and_a_decode_instance_behind_the_router():
    services = COMPOSE["services"]
    profiled = {name for name, svc in services.items() if svc.get("profiles") == ["disagg"]}
    assert profiled == {"prefill", "decode", "disagg-router"}
    config = parse_config(command_of("disagg-router")[3:])
    assert not config.replicas
    for role, specs in (("prefill", config.prefill), ("decode", config.decode)):
        (spec,) = specs
        replica = parse_replica(spec, config.kv_events_port, config.kv_snapshot_port)
        assert urllib.parse.urlsplit(replica.name).hostname == role
        cmd = command_of(role)
        assert cmd[:2] == ["folio", "serve"] and _serve_args(cmd) == role
        assert replica.kv_events.endswith(":" + cmd[cmd.index("--kv-events-port") + 1])
        assert replica.kv_snapshot.endswith(":" + cmd[cmd.index("--kv-snapshot-port") + 1])
        assert role in services["disagg-router"]["depends_on"]
    assert "--kv-transfer-port" in command_of("prefill")
    from folio.cli.main import build_parser  # folio serve takes the flags
    build_parser().parse_args(command_of("prefill")[1:])
    build_parser().parse_args(command_of("decode")[1:])


def test_the_kubernetes_manifests_validate_and_wire_the_roles():
    for doc in K8S:
        kubernetes_validate.validate(doc, "1.33.0", strict=True)
    sets = {d["metadata"]["labels"]["app.kubernetes.io/component"]: d for d in K8S if d["kind"] == "StatefulSet"}
    services = {d["metadata"]["name"]: d for d in K8S if d["kind"] == "Service"}
    assert set(sets) == {"prefill", "decode"}
    for role, sts in sets.items():
        pod = sts["spec"]["template"]["spec"]
        by_name = {c["name"]: c for c in pod["containers"]}
        for name in ("executor", "gateway"):
            cmd = by_name[name]["command"]
            assert cmd[cmd.index("--kv-role") + 1] == role
        for c in by_name.values():  # every command parses with its service's own flags
            importlib.import_module(f"folio.services.{c['command'][2]}.main")
            service_parser(c["command"][2], "x").parse_args(c["command"][3:])
        headless = services[sts["spec"]["serviceName"]]
        assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]
    prefill_exec = {c["name"]: c for c in sets["prefill"]["spec"]["template"]["spec"]["containers"]}["executor"]
    port = int(prefill_exec["command"][prefill_exec["command"].index("--kv-transfer-port") + 1])
    assert prefill_exec["ports"] == [{"name": "kv-transfer", "containerPort": port}]
    assert {p["name"]: p["port"] for p in services["folio-prefill"]["spec"]["ports"]}["kv-transfer"] == port
    (router,) = [d for d in K8S if d["kind"] == "Deployment"]
    config = parse_config(router["spec"]["template"]["spec"]["containers"][0]["command"][3:])
    # the router dials each StatefulSet's first pod by its stable name
    assert [urllib.parse.urlsplit(u).hostname for u in config.prefill] == ["folio-prefill-0.folio-prefill"]
    assert [urllib.parse.urlsplit(u).hostname for u in config.decode] == ["folio-decode-0.folio-decode"]
