"""Where the executor's start-up time goes: named phases, timed once per process.

The executor's loading code times its phases here (``weights``: reading and preparing the model,
``pool``: the KV pool, ``kernels``: compiling or loading the C/CUDA kernels, ``graphs``: CUDA graph
capture); its admin ``stats`` reply carries them (``startup``), and ``folio serve`` logs them with
each service's time to answer, once ``/health`` is healthy (``services/serve.py``).

``phase(name)`` adds the time of its block to ``name`` (a phase may run more than once: two kernel
libraries); ``note(name, value)`` keeps a fact about it (``weights_cache``: hit or miss).
``since_process_start()`` is the seconds since this process was created, imports included.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

PHASES: dict[str, float] = {}  # phase -> seconds
NOTES: dict[str, str] = {}  # phase facts: "weights_cache" -> "hit"


@contextmanager
def phase(name: str) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        PHASES[name] = PHASES.get(name, 0.0) + time.perf_counter() - t0


def note(name: str, value: str) -> None:
    NOTES[name] = value


def since_process_start() -> float:
    """Seconds since this process was created (the interpreter's start and imports included)."""
    import psutil

    return max(0.0, time.time() - psutil.Process().create_time())


def report() -> dict:
    """The phases so far, rounded to milliseconds, and the notes."""
    return {"phases": {k: round(v, 3) for k, v in PHASES.items()}, "notes": dict(NOTES)}
