"""The gateway's view of the services behind it: who answers, and who restarted.

One task per service (``GatewayService.start`` runs them) pings its admin socket every
``PROBE_INTERVAL_S`` with a ``PING_TIMEOUT_S`` deadline and keeps the answer; readers never wait on
a probe, so probing never slows serving, and what ``/health`` reports is never older than about a
second (an interval plus a deadline). A ping's reply names the process instance
(``folio.services.shell.INSTANCE``), which tells a restart from a pause.

More in docs/modules.md (services/gateway/health.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

STATEFUL = ("tokenizer", "scheduler")  # their restart loses the requests in flight
PROBE_INTERVAL_S = 0.5
PING_TIMEOUT_S = 0.5
DOWN_AFTER_S = 1.5  # about two missed pings: one late answer on a busy machine is not a crash
STALL_S = 5.0  # a tokenizer or scheduler silent this long is reported (its requests wait for it)

# (admin address, command, timeout) -> the reply's data, or None when absent, slow or refusing
AskAdmin = Callable[[str, str, float], Awaitable[dict | None]]


@dataclass
class ServiceHealth:
    last_ok: float | None = None  # monotonic time of the last answer
    failing: bool = False  # the latest ping went unanswered (or was refused)
    instance: str | None = None
    stall_reported: bool = False


class HealthMonitor:
    def __init__(self, addresses: dict[str, str], ask: AskAdmin, on_lost: Callable[[str, str], None]):
        self.addresses, self.ask, self.on_lost = addresses, ask, on_lost
        self.states = {name: ServiceHealth() for name in addresses}

    async def probe_all(self) -> None:
        """One round at once (the gateway's start: it knows the truth before its first request)."""
        replies = await asyncio.gather(*(self.ask(a, "ping", PING_TIMEOUT_S) for a in self.addresses.values()))
        now = time.monotonic()
        for name, reply in zip(self.addresses, replies):
            self.record(name, reply, now)

    async def run(self) -> None:
        await asyncio.gather(*(self._watch(name) for name in self.addresses))

    async def _watch(self, name: str) -> None:
        while True:
            t0 = time.monotonic()
            self.record(name, await self.ask(self.addresses[name], "ping", PING_TIMEOUT_S), time.monotonic())
            await asyncio.sleep(max(0.0, PROBE_INTERVAL_S - (time.monotonic() - t0)))

    def record(self, name: str, reply: dict | None, now: float) -> None:
        state = self.states[name]
        if reply is not None:
            instance = reply.get("instance")
            if state.instance is not None and instance != state.instance and name in STATEFUL:
                self.on_lost(name, "restarted")
            state.last_ok, state.instance, state.stall_reported, state.failing = now, instance, False, False
            return
        state.failing = True
        silent = now - state.last_ok if state.last_ok is not None else 0.0
        if name in STATEFUL and silent > STALL_S and not state.stall_reported:
            state.stall_reported = True
            self.on_lost(name, f"has not answered for {silent:.0f}s")

    def heard_from(self, name: str, now: float) -> None:
        """Output arrived from ``name``: it is alive even if a busy event loop answers its pings
        late (a tokenizer detokenizing a large step). Restarts are still told by the pings."""
        state = self.states.get(name)
        if state is not None and state.last_ok is not None:
            state.last_ok, state.failing = max(state.last_ok, now), False

    def down(self, now: float | None = None) -> list[str]:
        """The services that never answered, or whose latest ping failed and that have not
        answered for ``DOWN_AFTER_S``. Silence alone is not enough: when the gateway's own loop
        was blocked, nobody asked, and the services are not to blame."""
        now = time.monotonic() if now is None else now
        return [name for name, s in self.states.items()
                if s.last_ok is None or (s.failing and now - s.last_ok > DOWN_AFTER_S)]

    def report(self) -> dict:
        now = time.monotonic()
        down = self.down(now)
        services = {name: {"status": "down" if name in down else "ok",
                           "last_answer_s_ago": None if s.last_ok is None else round(now - s.last_ok, 3)}
                    for name, s in self.states.items()}
        return {"status": "unavailable" if down else "ok", "down": down, "services": services}
