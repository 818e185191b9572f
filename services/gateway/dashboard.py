"""The live KV page: ``GET /dashboard`` and the JSON it polls.

More in docs/modules.md (services/gateway/dashboard.py).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from importlib import resources

from aiohttp import web

from folio.services.gateway.protocol import ApiError

SAMPLE_INTERVAL_S = 1.0
HISTORY_LEN = 300  # samples: five minutes
IDLE_STOP_S = 30.0  # no poll for this long: stop sampling
STATIC = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
# the scheduler's running totals the samples difference
_TOTALS = ("num_steps", "step_seconds_total", "num_scheduled_seqs_total", "num_scheduled_tokens_total",
           "num_preemptions")


def sample(now: float, sched: dict | None, kv: dict | None, prev: dict | None, executor: dict | None = None) -> dict:
    """One point of every plot; ``prev``: the sample before (None: the first)."""
    sched, kv, executor = sched or {}, kv or {}, executor or {}
    totals = {k: sched.get(k, 0) or 0 for k in _TOTALS}
    totals["hits"] = kv.get("num_prefix_cache_hits", 0) or 0
    totals["queries"] = kv.get("num_prefix_cache_queries", 0) or 0
    # images in: the placeholder tokens the vision tower filled, and its time
    totals["image_tokens"] = executor.get("num_image_tokens_encoded", 0) or 0
    totals["encoder_seconds"] = executor.get("encoder_seconds_total", 0.0) or 0.0
    point = {"t": round(now, 2), "running": sched.get("num_running"), "waiting": sched.get("num_waiting"),
             "swapped": sched.get("num_swapped"), "kv_usage": kv.get("usage"), "step_ms": None,
             "batch_size": None, "budget_use": None, "hit_rate": None, "preemptions": None,
             "image_tokens": None, "encoder_use": None, "dt": None, "_totals": totals}
    if prev is None or any(totals[k] < prev["_totals"][k] for k in totals):  # the first, or a restart
        return point
    d = {k: totals[k] - prev["_totals"][k] for k in totals}
    point["dt"] = round(now - prev["t"], 3)
    budget = sched.get("max_num_batched_tokens") or 0
    if d["num_steps"]:
        point["step_ms"] = 1000.0 * d["step_seconds_total"] / d["num_steps"]
        point["batch_size"] = d["num_scheduled_seqs_total"] / d["num_steps"]
        point["budget_use"] = d["num_scheduled_tokens_total"] / d["num_steps"] / budget if budget else None
    else:
        point["batch_size"] = point["budget_use"] = 0.0
    point["hit_rate"] = d["hits"] / d["queries"] if d["queries"] else None
    point["preemptions"] = d["num_preemptions"]
    point["image_tokens"] = d["image_tokens"]  # the page shows it per second, as preemptions
    point["encoder_use"] = d["encoder_seconds"] / point["dt"] if point["dt"] else None  # the tower's share of the time
    return point


class History:
    """The last ``HISTORY_LEN`` samples, taken while the page is watched."""

    def __init__(self, service):
        self.service = service
        self.samples: deque[dict] = deque(maxlen=HISTORY_LEN)
        self.last_stats: tuple[dict | None, dict | None] = (None, None)
        self.last_poll = 0.0
        self.task: asyncio.Task | None = None
        self.lock = asyncio.Lock()  # one sample at a time, in order

    def age(self) -> float:
        return time.time() - self.samples[-1]["t"] if self.samples else float("inf")

    async def take(self) -> None:
        async with self.lock:
            ep, timeout = self.service.config.endpoints, self.service.config.admin_timeout_s
            sched, kv, executor = await asyncio.gather(self.service.ask_admin(ep.admin_scheduler, "stats", timeout),
                                                       self.service.ask_admin(ep.admin_kvmanager, "stats", timeout),
                                                       self.service.ask_admin(ep.admin_executor, "stats", timeout))
            prev = self.samples[-1] if self.samples else None
            self.samples.append(sample(time.time(), sched, kv, prev, executor))
            self.last_stats = (sched, kv)

    async def watched(self) -> None:
        """A poll: a sample no older than half an interval (the page's figures then match its
        block map), and sampling goes on for a while (a browser slows the timers of a hidden tab)."""
        self.last_poll = time.monotonic()
        if self.task is None or self.task.done():
            self.task = asyncio.ensure_future(self._run())
        if self.age() >= SAMPLE_INTERVAL_S / 2:
            await self.take()

    async def _run(self) -> None:
        while time.monotonic() - self.last_poll < IDLE_STOP_S:
            await asyncio.sleep(max(0.05, SAMPLE_INTERVAL_S - self.age()))
            if self.age() >= 0.9 * SAMPLE_INTERVAL_S:
                await self.take()

    def since(self, t: float) -> list[dict]:
        return [{k: v for k, v in s.items() if k != "_totals"} for s in self.samples if s["t"] > t]

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


HISTORY = web.AppKey("dashboard_history", History)


def _query_number(request: web.Request, name: str, default, kind=float):
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        return kind(raw)
    except ValueError:
        raise ApiError(f"{name} must be a number, got {raw!r}", 400, param=name) from None


async def page(request: web.Request) -> web.Response:
    text = resources.files(__package__).joinpath("static/dashboard.html").read_text()
    return web.Response(text=text, content_type="text/html", headers={"Cache-Control": "no-cache"})


async def static(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in STATIC:
        raise web.HTTPNotFound()
    text = resources.files(__package__).joinpath(f"static/{name}").read_text()
    return web.Response(text=text, content_type=STATIC[name], headers={"Cache-Control": "no-cache"})


async def state(request: web.Request) -> web.Response:
    history = request.app[HISTORY]
    service = history.service
    since = _query_number(request, "since", 0.0)
    cells = _query_number(request, "cells", 2048, int)
    if not 1 <= cells <= 8192:
        raise ApiError(f"cells must be between 1 and 8192, got {cells}", 400, param="cells")
    ep = service.config.endpoints
    args = {"max_cells": cells}
    if request.query.get("req_id"):
        args["req_id"] = request.query["req_id"]
    # the figures and the map asked at once: what the page shows is of one moment
    _, kv_map = await asyncio.gather(history.watched(), service.ask_admin(
        ep.admin_kvmanager, "map", 2 * service.config.admin_timeout_s, args))
    sched, kv = history.last_stats
    now = {k: (sched or {}).get(k) for k in ("num_running", "num_waiting", "num_swapped", "num_preemptions",
                                             "max_num_seqs", "max_num_batched_tokens", "num_steps")}
    now.update({k: (kv or {}).get(k) for k in ("num_blocks_total", "num_blocks_used", "num_blocks_cached",
                                               "num_blocks_free", "block_size", "prefix_cache_hit_rate",
                                               "num_host_blocks_total", "num_host_blocks_used", "usage",
                                               "tiers")})
    return web.json_response({"model": service.config.model_name, "time": time.time(),
                              "interval_s": SAMPLE_INTERVAL_S, "down": service.health.down(),
                              "now": now, "map": kv_map, "samples": history.since(since)})


def add_dashboard_routes(app: web.Application, service) -> None:
    app[HISTORY] = History(service)

    async def stop_sampling(app: web.Application) -> None:
        await app[HISTORY].stop()

    app.on_cleanup.append(stop_sampling)
    app.router.add_get("/dashboard", page)
    app.router.add_get("/dashboard/static/{name}", static)
    app.router.add_get("/dashboard/api/state", state)
