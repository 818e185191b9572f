"""A compose project on a real Docker engine, for tests/deploy/test_compose_live.py: find (or, in
CI, start) the engine, build the image with scripts/image.sh, bring a profile up under a project
name and host port of its own, wait for health, crash a container's process, tear it all down.
Talks to the engine through the docker and compose command lines only."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
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


def compose_command() -> list[str] | None:
    """Compose v2 (`docker compose`) when the client has it, else Compose 1.29 (`docker-compose`)."""
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


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


@dataclass
class Stack:
    """One compose project: ``project`` names its containers, volumes and network; ``tag`` its image."""

    profile: str
    project: str = field(default_factory=lambda: f"foliotest{os.getpid()}")
    tag: str = field(default_factory=lambda: f"test-{os.getpid()}")
    port: int = field(default_factory=free_port)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "COMPOSE_PROJECT_NAME": self.project, "FOLIO_TAG": self.tag,
                "FOLIO_PORT": str(self.port), "FOLIO_BATCH_INVARIANT": "1"}

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        cmd = [*compose_command(), "-f", str(ROOT / "compose.yaml"), "--profile", self.profile, *args]
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

    def up(self, service: str = "gateway", deadline_s: float = 900) -> None:
        t0 = time.monotonic()
        self.compose("up", "-d", timeout=deadline_s)
        self.wait_healthy(service, deadline_s - (time.monotonic() - t0))
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

    def exec(self, service: str, *cmd: str) -> subprocess.CompletedProcess:
        return self.compose("exec", "-T", service, *cmd, timeout=120)

    def logs(self, tail: int = 15) -> str:
        cmd = [*(compose_command() or ["docker-compose"]), "-f", str(ROOT / "compose.yaml"), "--profile",
               self.profile, "logs", "--no-color", "--tail", str(tail)]
        try:
            run = subprocess.run(cmd, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=60)
            return run.stdout[-6000:]
        except (OSError, subprocess.SubprocessError) as exc:
            return f"(no logs: {exc!r})"

    def down(self) -> None:
        """Containers, network, the project's volumes and the test's image. The base image, the
        dependency layers and the shared model cache (the `folio-models` volume) stay as caches."""
        self.compose("down", "--remove-orphans", "--rmi", "all", "-t", "20", timeout=300, check=False)
        for volume in ("kv", "keys"):
            subprocess.run(["docker", "volume", "rm", "-f", f"{self.project}_{volume}"], capture_output=True)
        subprocess.run(["docker", "rmi", "-f", f"folio:{self.tag}"], capture_output=True)
