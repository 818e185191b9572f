"""deploy/kubernetes: every manifest valid against the Kubernetes schemas (kubernetes-validate,
its bundled schemas, strict: unknown fields are errors), and shaped as the router and the services
expect: a replica pod of the five services over tcp, GPU for the executor, probes on the gateway's
/health, a headless Service with the ports the router dials, a PodDisruptionBudget, named metrics
ports, and commands every service's own parser accepts."""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from folio.cli.main import RUNNABLE
from folio.shared.config import Endpoints, RouterConfig

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
DOCS = [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]
K8S_VERSION = "1.33.0"  # an old enough cluster: what validates here runs on current ones too
TCP = Endpoints.tcp(5550)


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


def find(kind: str, component: str) -> dict:
    (doc,) = [d for d in DOCS if d["kind"] == kind and d["metadata"]["labels"]["app.kubernetes.io/component"] == component]
    return doc


def containers(deployment: dict) -> dict[str, dict]:
    return {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_each_manifest_validates_against_the_kubernetes_schemas(doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_validator_catches_mistakes():
    broken = copy.deepcopy(find("Deployment", "replica"))
    broken["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "5555"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)
    typo = copy.deepcopy(find("Service", "replica"))
    typo["spec"]["clusterIp"] = "None"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, K8S_VERSION, strict=True)


def test_a_replica_is_a_pod_of_the_five_services_over_tcp_with_a_gpu_and_gateway_probes():
    replica = find("Deployment", "replica")
    pod = replica["spec"]["template"]["spec"]
    by_name = containers(replica)
    assert {c["command"][2] for c in by_name.values()} == set(RUNNABLE) - {"router"}
    for c in by_name.values():
        env = {e["name"]: e["value"] for e in c["env"]}
        assert env["FOLIO_ENDPOINTS"] == "tcp" and env["FOLIO_BASE_PORT"] == "5550"
    # every host the tcp layout names (but the router's) is this pod
    hosts = {a.removeprefix("tcp://").rpartition(":")[0] for a in vars(TCP).values()} - {"router"}
    assert hosts <= set(pod["hostAliases"][0]["hostnames"]) and pod["hostAliases"][0]["ip"] == "127.0.0.1"
    assert by_name["executor"]["resources"]["limits"]["nvidia.com/gpu"] == 1
    gateway = by_name["gateway"]
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}  # every service answers
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/live", "port": "http"}  # the gateway itself
    kv_ports = {p["name"]: p["containerPort"] for p in by_name["kvmanager"]["ports"]}
    assert kv_ports == {"kv-events": port_of(TCP.kv_events), "kv-snapshot": port_of(TCP.kv_snapshot)}
    annotations = replica["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(gateway["ports"][0]["containerPort"])


def test_the_router_finds_replicas_through_a_headless_service_on_the_ports_they_publish():
    headless = find("Service", "replica")
    assert headless["spec"]["clusterIP"] == "None"
    ports = {p["name"]: p["port"] for p in headless["spec"]["ports"]}
    defaults = RouterConfig(endpoints=TCP)
    assert ports["kv-events"] == defaults.kv_events_port == port_of(TCP.kv_events)
    assert ports["kv-snapshot"] == defaults.kv_snapshot_port == port_of(TCP.kv_snapshot)
    router = containers(find("Deployment", "router"))["router"]
    from folio.services.router.main import parse_config

    config = parse_config(router["command"][3:])
    assert config.replica_dns == f"{headless['metadata']['name']}:{ports['http']}"
    assert router["readinessProbe"]["httpGet"]["path"] == "/health"
    assert router["livenessProbe"]["exec"]["command"] == ["folio", "health", "router"]


def test_disruption_budgets_cover_replicas_and_routers():
    for component in ("replica", "router"):
        pdb = find("PodDisruptionBudget", component)
        selected = pdb["spec"]["selector"]["matchLabels"]
        assert selected == find("Deployment", component)["spec"]["selector"]["matchLabels"]


def test_service_commands_parse_with_their_own_flags():
    import importlib

    for deployment in (find("Deployment", "replica"), find("Deployment", "router")):
        for c in containers(deployment).values():
            importlib.import_module(f"folio.services.{c['command'][2]}.main").parse_config(c["command"][3:])
