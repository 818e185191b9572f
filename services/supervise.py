"""The supervisor of ``folio serve``: start the service processes, restart one that dies, stop
them all in order.

``serve.py`` gives it one command line per service (in start order). A child that dies is
restarted after a backoff that doubles with each death of that service within the last minute
(``BACKOFF_FIRST_S`` up to ``BACKOFF_MAX_S``); its ``max_restarts``-th death within a minute stops
everything with a message, as does any death with ``restart=False`` (``--no-restart``).

Waiting costs nothing: one ``select`` on the children's pidfds, with the next due restart as its
timeout. SIGTERM/SIGINT end the wait; then the gateway is stopped first (it drains its open
streams while the services behind it still run), then the rest together, each SIGKILLed if it
outlives ``STOP_TIMEOUT_S``.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable

STOP_TIMEOUT_S = 10.0
RESTART_WINDOW_S = 60.0
BACKOFF_FIRST_S = 0.25
BACKOFF_MAX_S = 8.0
FIRST_TO_STOP = "gateway"


class _Stop(Exception):
    """Raised from the SIGTERM/SIGINT handler to leave the wait for children."""


def describe_exit(status: int) -> str:
    if status < 0:
        return f"was killed by {signal.Signals(-status).name}"
    return f"exited with code {status}"


def say(message: str) -> None:
    print(f"folio: {message}", file=sys.stderr, flush=True)


class Supervisor:
    def __init__(self, commands: dict[str, list[str]], env: dict[str, str], *, restart: bool = True,
                 max_restarts: int = 5, preexec_fn: Callable[[], None] | None = None):
        self.commands, self.env, self.preexec_fn = commands, env, preexec_fn
        self.restart, self.max_restarts = restart, max_restarts
        self.procs: dict[str, subprocess.Popen] = {}
        self.pidfds: dict[str, int] = {}
        self.deaths: dict[str, deque[float]] = {name: deque() for name in commands}
        self.due: dict[str, float] = {}  # service -> when its restart is due (monotonic)

    def run(self) -> int:
        """Start every service and supervise until a signal (0) or a fatal death (1)."""

        def on_signal(signum, frame):
            raise _Stop(signal.Signals(signum).name)

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        code = 0
        try:
            for name in self.commands:
                self.start(name)
            code = self.watch()
        except _Stop as stop:
            say(f"{stop} received, stopping the services")
        finally:
            for sig in previous:
                signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not cut the shutdown short
            self.stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return code

    def start(self, name: str) -> None:
        proc = subprocess.Popen(self.commands[name], env=self.env, start_new_session=True,
                                preexec_fn=self.preexec_fn)
        self.procs[name] = proc
        self.pidfds[name] = os.pidfd_open(proc.pid)

    def watch(self) -> int:
        """Wait for deaths and due restarts; return 1 when one death is fatal."""
        while True:
            timeout = max(0.0, min(self.due.values()) - time.monotonic()) if self.due else None
            by_fd = {fd: name for name, fd in self.pidfds.items()}
            ready, _, _ = select.select(list(by_fd), [], [], timeout)
            for fd in ready:
                name = by_fd[fd]
                os.close(self.pidfds.pop(name))
                status = self.procs[name].wait()
                if not self.on_death(name, status):
                    return 1
            now = time.monotonic()
            for name in [n for n, t in self.due.items() if t <= now]:
                del self.due[name]
                self.start(name)
                say(f"the {name} service restarted (pid {self.procs[name].pid})")

    def on_death(self, name: str, status: int) -> bool:
        """Schedule a restart; False when the death is fatal (no restarts, or too many)."""
        if not self.restart:
            say(f"the {name} service {describe_exit(status)}; stopping the others")
            return False
        now = time.monotonic()
        deaths = self.deaths[name]
        deaths.append(now)
        while deaths and now - deaths[0] > RESTART_WINDOW_S:
            deaths.popleft()
        if len(deaths) > self.max_restarts:
            say(f"the {name} service {describe_exit(status)}, its {len(deaths)}th death within "
                f"{RESTART_WINDOW_S:.0f}s (--max-restarts {self.max_restarts}); stopping everything")
            return False
        delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (len(deaths) - 1))
        say(f"the {name} service {describe_exit(status)}; restarting it in {delay:.2g}s "
            f"(death {len(deaths)} within {RESTART_WINDOW_S:.0f}s, at most {self.max_restarts} restarts)")
        self.due[name] = now + delay
        return True

    def stop_all(self) -> None:
        """SIGTERM the gateway and wait for it to drain, then every other live child together;
        SIGKILL what is still there after the timeout."""
        for fd in self.pidfds.values():
            os.close(fd)
        self.pidfds.clear()
        alive = [(n, p) for n, p in reversed(self.procs.items()) if p.poll() is None]
        _stop([(n, p) for n, p in alive if n == FIRST_TO_STOP])
        _stop([(n, p) for n, p in alive if n != FIRST_TO_STOP])


def _stop(procs: list[tuple[str, subprocess.Popen]]) -> None:
    for _, proc in procs:
        try:
            proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for name, proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"folio: the {name} service did not stop in {STOP_TIMEOUT_S:.0f}s; killing it", file=sys.stderr)
            proc.kill()
            proc.wait()
        if proc.returncode not in (0, -signal.SIGTERM):
            print(f"folio: the {name} service {describe_exit(proc.returncode)} while stopping", file=sys.stderr)
