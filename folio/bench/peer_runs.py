"""One server at a time for ``folio bench cpu-vs-llamacpp``: its start, its memory, its workloads.

``MeasuredServer`` (a command and its process tree's peak RSS and PSS), the workloads
(``single_stream``, ``mixed``, ``first_token_s``), a file's place in the page cache
(``page_cache_share``, ``evict_page_cache``) and the folio cache a cold start empties (``FolioCache``).

More in docs/modules.md (folio/bench/peer_runs.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import mmap
import os
import random
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

WORDS = ("the of and to in is was for on that with as by at from his her it an were are which this be or has had "
         "not but one their they its first also new after who two been other when more time she there all into year "
         "some would than most over about world only can out up during school while people city made under used well "
         "between both may later part where three many before state being then found however such through area same "
         "known work since became film war team called around including until them each like life four high second "
         "back best several north south east west small large long last him any").split()
STORY = "Write a long story about a lighthouse keeper."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MemorySampler(threading.Thread):
    """The peak, over its life, of the RSS and the PSS summed over a process and its descendants."""

    def __init__(self, pid: int, interval_s: float = 0.2):
        super().__init__(daemon=True)
        self.pid, self.interval_s = pid, interval_s
        self.peak_rss = self.peak_pss = 0
        self.done = threading.Event()

    def sample(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        rss = pss = 0
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                info = proc.memory_full_info()  # PSS: shared pages (libraries, a mapped file) counted once
                rss += info.rss
                pss += info.pss
        self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)

    def run(self) -> None:
        while not self.done.is_set():
            self.sample()
            self.done.wait(self.interval_s)


class MeasuredServer:
    """``command`` started in its own session in ``log``'s folder (ik_llama.cpp writes a ``llama.log``
    where it runs), logging to ``log``, its memory sampled from the start."""

    def __init__(self, name: str, command: list[str], port: int, env: dict, log: Path):
        self.name, self.port, self.log = name, port, log
        self.started = time.perf_counter()
        with open(log, "w") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=log.parent,
                                         start_new_session=True)
        self.memory = MemorySampler(self.proc.pid)
        self.memory.start()

    def wait_healthy(self, timeout_s: float = 1800.0) -> float:
        """Seconds from the launch to the first 200 on ``/health``."""
        import urllib.request

        deadline = self.started + timeout_s
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}): {self.log.read_text()[-3000:]}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return time.perf_counter() - self.started
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} not healthy in {timeout_s:.0f} s: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.memory.done.set()
        self.memory.join()


# --------------------------------------------------------------------------- the workloads


async def complete(session, port: int, model: str, prompt, max_tokens: int) -> dict:
    """One streamed completion; its ``usage`` (from the stream's last chunks). Streamed because
    a random-weight model's bytes need not form UTF-8 text: ik_llama.cpp then fails a whole
    unstreamed answer with HTTP 500, while each server's stream holds back a partial character."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    usage = None
    async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"the stream ended in an error: {event['error']}")
            usage = event.get("usage") or usage
    if usage is None:
        raise RuntimeError("the stream carried no usage")
    return usage


def _session(total_s: float):
    import aiohttp

    # a connection a request (none kept alive): llama-server may close a connection after a stream,
    # and a pooled client would send the next request on it
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=total_s),
                                 connector=aiohttp.TCPConnector(force_close=True, limit=0))


async def _single_stream(port: int, model: str, tokens: int) -> float:
    async with _session(1800) as session:
        t0 = time.perf_counter()
        usage = await complete(session, port, model, STORY, tokens)
        return usage["completion_tokens"] / (time.perf_counter() - t0)


def single_stream(port: int, model: str, tokens: int) -> float:
    """Tokens a second of one completion of ``tokens`` tokens."""
    return asyncio.run(_single_stream(port, model, tokens))


def mixed_requests(seed: int = 0, num: int = 48) -> list[tuple[str, int]]:
    """Prompts of 16-160 words and 8-80 output tokens, seeded."""
    rng = random.Random(seed)
    return [(" ".join(rng.choice(WORDS) for _ in range(rng.randint(16, 160))), rng.randint(8, 80))
            for _ in range(num)]


async def _mixed(port: int, model: str, requests: list[tuple[str, int]], concurrency: int) -> float:
    gate = asyncio.Semaphore(concurrency)
    async with _session(3600) as session:
        async def one(prompt: str, max_tokens: int) -> int:
            async with gate:
                return (await complete(session, port, model, prompt, max_tokens))["completion_tokens"]

        t0 = time.perf_counter()
        done = await asyncio.gather(*(one(p, m) for p, m in requests))
        return sum(done) / (time.perf_counter() - t0)


def mixed(port: int, model: str, requests: list[tuple[str, int]], concurrency: int) -> float:
    """Output tokens a second over ``requests``, ``concurrency`` at once."""
    return asyncio.run(_mixed(port, model, requests, concurrency))


def long_prompts(num: int, length: int, seed: int = 0, vocab: tuple[int, int] = (1000, 40000)) -> list[list[int]]:
    """``num`` prompts of ``length`` token ids, each with its own first tokens (so no prefix cache
    serves one from another), drawn from ordinary ids of SmolLM2's vocabulary (every shape's)."""
    rng = random.Random(seed)
    return [[rng.randrange(*vocab) for _ in range(length)] for _ in range(num)]


async def _first_token_s(port: int, model: str, prompt: list[int]) -> float:
    async with _session(3600) as session:
        t0 = time.perf_counter()
        usage = await complete(session, port, model, prompt, 1)
        elapsed = time.perf_counter() - t0
    if usage["prompt_tokens"] != len(prompt):  # a server that added tokens computed another prompt
        raise RuntimeError(f"the server counted {usage['prompt_tokens']} prompt tokens, not {len(prompt)}")
    return elapsed


def first_token_s(port: int, model: str, prompt: list[int]) -> float:
    """Seconds to a one-token completion of ``prompt`` (token ids): its time to first token."""
    return asyncio.run(_first_token_s(port, model, prompt))


# --------------------------------------------------------------------------- caches


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    return libc


def page_cache_share(path: str | Path) -> float:
    """The share of ``path``'s pages in the page cache (``mincore`` over a mapping of it)."""
    size = os.path.getsize(path)
    if size == 0:
        return 1.0
    libc = _libc()
    page = mmap.PAGESIZE
    num_pages = (size + page - 1) // page
    with open(path, "rb") as f:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        try:
            vec = (ctypes.c_ubyte * num_pages)()
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
        finally:
            libc.munmap(addr, size)
    return sum(v & 1 for v in vec) / num_pages


def evict_page_cache(path: str | Path) -> None:
    """Ask the kernel to drop ``path``'s clean pages from the page cache (mapped pages stay)."""
    with open(path, "rb") as f:
        with contextlib.suppress(OSError):  # dirty pages stay cached: write them first
            os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


class FolioCache:
    """The folio cache folder the benchmark's folio runs with (``FOLIO_CACHE_DIR``): its compiled
    kernels and prepared default model are links to the user's, and ``empty`` removes the rest
    (whatever folio keeps per model file, its prepared-model cache among it) for a cold start."""

    SHARED = ("cpu-kernels", "models")

    def __init__(self, folder: Path, user_cache: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        for name in self.SHARED:
            link, target = folder / name, user_cache / name
            target.mkdir(parents=True, exist_ok=True)
            if not link.is_symlink():
                link.symlink_to(target, target_is_directory=True)

    def empty(self) -> None:
        import shutil

        for entry in self.folder.iterdir():
            if entry.name in self.SHARED and entry.is_symlink():
                continue
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()

    def env(self) -> dict:
        return {"FOLIO_CACHE_DIR": str(self.folder)}
