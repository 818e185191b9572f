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


def _pods() -> list[tuple[dict, dict]]:
    """(workload, pod spec) of every workload in deploy/kubernetes."""
    return [(d, d["spec"]["template"]["spec"]) for d in DOCS if d["kind"] in ("Deployment", "StatefulSet")]


@pytest.fixture(scope="module")
def split_files(tmp_path_factory) -> dict[str, set[str]]:
    """service -> the files ``folio keys split --service`` writes for it (relative paths)."""
    from folio.shared.keys import SERVICES, init_keys, split_keys

    root = tmp_path_factory.mktemp("keys")
    init_keys(root / "stack")
    out = {}
    for name in SERVICES:
        split_keys(root / "stack", root / name, [name])
        out[name] = {str(p.relative_to(root / name)) for p in (root / name).rglob("*") if p.is_file()}
    return out


@pytest.mark.parametrize("workload,pod", _pods(), ids=lambda x: x.get("metadata", {}).get("name", ""))
def test_every_pod_is_restricted_and_each_container_reads_only_its_own_service_keys(workload, pod, split_files):
    """Pod Security "restricted": non-root, seccomp RuntimeDefault, no privilege escalation, every
    capability dropped; a read-only root filesystem. Each service's container mounts at /keys
    (FOLIO_KEYS_DIR) the folio-keys-NAME Secret of its own service: the files ``folio keys split
    --service NAME`` writes (its own server secret, no other service's), each Secret key the file's
    name (``kubectl create secret generic --from-file``); the init container mounts no keys."""
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    for c in pod.get("initContainers", []) + pod["containers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True, c["name"]
        assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
        assert {"name": "FOLIO_KEYS_DIR", "value": "/keys"} in c["env"], c["name"]
        assert "tmp" in {m["name"] for m in c["volumeMounts"]}, c["name"]
        assert all(m["name"] in volumes for m in c["volumeMounts"]), c["name"]
    for c in pod.get("initContainers", []):
        assert not any(m["mountPath"] == "/keys" for m in c["volumeMounts"]), c["name"]
    for c in pod["containers"]:
        service = c["command"][2]
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/keys"]
        assert mount["readOnly"] is True
        secret = volumes[mount["name"]]["secret"]
        assert secret["secretName"] == f"folio-keys-{service}", c["name"]
        paths = {i["path"] for i in secret["items"]}
        assert paths == split_files[service], (c["name"], paths ^ split_files[service])
        assert {p for p in paths if p.startswith("services/") and p.endswith("_secret")} == \
            {f"services/{service}.key_secret"}
        assert all(i["key"] == i["path"].rpartition("/")[2] for i in secret["items"]), c["name"]


def _allowed(port: int, labels: dict) -> list[dict | None]:
    """The ``from`` of every policy rule that opens ``port`` on a pod with ``labels`` (None: anyone)."""
    def selects(selector: dict) -> bool:
        ok = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
        return ok and all((labels.get(e["key"]) in e["values"]) == (e["operator"] == "In")
                          for e in selector.get("matchExpressions", []))
    out = []
    for policy in (d for d in DOCS if d["kind"] == "NetworkPolicy"):
        if not selects(policy["spec"]["podSelector"]):
            continue
        for rule in policy["spec"].get("ingress", []):
            if any(p["port"] == port for p in rule.get("ports", [])):
                out.append(rule.get("from"))
    return out


def test_network_policies_open_each_port_only_to_whom_speaks_to_it():
    policies = [d for d in DOCS if d["kind"] == "NetworkPolicy"]
    deny = [p for p in policies if p["spec"]["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "folio"}}
            and "ingress" not in p["spec"]]
    assert deny, "every folio pod takes nothing unless a policy opens a port"
    for workload, pod in _pods():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        for c in pod["containers"]:
            for port in c.get("ports", []):
                rules = _allowed(port["containerPort"], labels)
                assert rules, f"{workload['metadata']['name']}: port {port['containerPort']} is closed to all"
                if port["containerPort"] in (8000, 8080):
                    continue  # HTTP: anyone (the API key guards it)
                for frm in rules:  # internal ports: only named folio pods
                    assert frm and all(f["podSelector"] for f in frm), (workload["metadata"]["name"], port)
    # the KV transfer port of a prefill pod: decode pods only
    assert _allowed(5570, {"app.kubernetes.io/name": "folio", "app.kubernetes.io/component": "prefill"}) == [
        [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "folio", "app.kubernetes.io/component": "decode"}}}]]
    assert not _allowed(5570, {"app.kubernetes.io/name": "folio", "app.kubernetes.io/component": "replica"})
