"""Benchmark: how many tokens per second the gateway and the tokenizer stream to many SSE clients.

More in docs/modules.md (folio/bench/streams.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import msgspec
import zmq
import zmq.asyncio

from folio.shared.config import DEFAULT_MODEL_NAME, Endpoints
from folio.services.shell import freeze_heap, serve_admin
from folio.shared.transport import QUIET
from folio.shared.messages import AbortRequest, EngineRequest, TokenBatch, TokenDelta
from folio.shared.transport import Decoder, encode, make_socket

# what every stream says, over and over: accents, CJK and an emoji split over several tokens
SCRIPT_TEXT = " Streams of text — naïve café, 数据流 and 🚀 rockets, again and again."
PROMPT = "Tell me a story about streams."


class FakeBackend:
    """The scheduler's side of the tokenizer: every ``step_s``, one token for each running request."""

    def __init__(self, ctx, endpoints: Endpoints, token_ids: list[int], step_s: float):
        self.recv_from_tokenizer = make_socket(ctx, zmq.PULL, endpoints.scheduler_in)
        self.send_to_tokenizer = make_socket(ctx, zmq.PUSH, endpoints.tokenizer_in)
        self.admins = [make_socket(ctx, zmq.ROUTER, getattr(endpoints, f"admin_{name}"))
                       for name in ("scheduler", "kvmanager", "executor")]
        self.decoder = Decoder(EngineRequest, AbortRequest)
        self.token_ids, self.step_s = token_ids, step_s
        self.running: dict[str, list[int]] = {}  # req_id -> [num tokens sent, max_tokens]
        self.num_steps = self.num_tokens = self.num_late_steps = 0
        self.num_aborts = 0
        self.request_times: list[float] = []  # perf_counter when each request arrived

    async def run(self) -> None:
        tasks = [asyncio.ensure_future(serve_admin(sock, {}, QUIET)) for sock in self.admins]
        loop = asyncio.get_running_loop()
        next_step = loop.time()
        try:
            while True:
                while await self.recv_from_tokenizer.poll(0):
                    self._take(self.decoder.decode(await self.recv_from_tokenizer.recv()))
                if self.running:
                    await self.send_to_tokenizer.send(encode(self._step()))
                next_step += self.step_s
                wait = next_step - loop.time()
                if wait < -self.step_s:  # more than a step behind: count it, do not burst to catch up
                    self.num_late_steps += 1
                    next_step = loop.time()
                await asyncio.sleep(max(0.0, wait))
        finally:
            for task in tasks:
                task.cancel()

    def _take(self, msg) -> None:
        if isinstance(msg, AbortRequest):
            self.num_aborts += 1
            self.running.pop(msg.req_id, None)
            return
        self.request_times.append(time.perf_counter())
        for req_id in (msg.req_id, *msg.fork_req_ids):
            self.running[req_id] = [0, msg.sampling.max_tokens]

    def _step(self) -> TokenBatch:
        """The scheduler's shape: a request's first and last deltas as structs, the others flat."""
        deltas, plain_req_ids, plain_token_ids = [], [], []
        ids = self.token_ids
        for req_id, state in list(self.running.items()):
            num_sent, max_tokens = state
            state[0] = num_sent + 1
            done = state[0] >= max_tokens
            token_id = ids[num_sent % len(ids)]
            if num_sent and not done:
                plain_req_ids.append(req_id)
                plain_token_ids.append(token_id)
                continue
            deltas.append(TokenDelta(req_id=req_id, token_ids=[token_id], finish_reason="length" if done else None,
                                     num_prompt_tokens=8 if num_sent == 0 else 0))
            if done:
                del self.running[req_id]
        self.num_steps += 1
        self.num_tokens += len(deltas) + len(plain_req_ids)
        return TokenBatch(step_id=self.num_steps, deltas=deltas, plain_req_ids=plain_req_ids,
                          plain_token_ids=plain_token_ids)

    def close(self) -> None:
        for sock in (self.recv_from_tokenizer, self.send_to_tokenizer, *self.admins):
            sock.close(linger=0)


def expected_text(tokenizer, token_ids: list[int], max_tokens: int) -> str:
    """What one stream must say: the backend's first ``max_tokens`` tokens, decoded at once (less a
    character that ``max_tokens`` cut in half: its first bytes never make text)."""
    ids = [token_ids[i % len(token_ids)] for i in range(max_tokens)]
    return tokenizer.decode(ids).rstrip("\ufffd")


# --------------------------------------------------------------------------- the services


class Services:
    """The real tokenizer and gateway as processes, on the ipc sockets of one run folder."""

    def __init__(self, model: str, port: int, log_level: str = "warning", profile_dir: str | None = None):
        self.run_dir = tempfile.mkdtemp(prefix="folio-bs-", dir="/tmp")
        self.endpoints = Endpoints.ipc(self.run_dir)
        self.port = port
        env = {**os.environ, "FOLIO_ENDPOINTS": "ipc", "FOLIO_RUN_DIR": self.run_dir}
        common = ["--model", model, "--log-level", log_level]
        self.procs = {}
        for name, extra in (("tokenizer", []), ("gateway", ["--host", "127.0.0.1", "--port", str(port)])):
            # with a profile folder, each service runs under cProfile (written when it stops)
            profile = ["-m", "cProfile", "-o", f"{profile_dir}/{name}.prof"] if profile_dir else []
            self.procs[name] = subprocess.Popen(
                [sys.executable, *profile, "-m", "folio.cli.main", "run", name, *common, *extra], env=env)

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Until the gateway's /ready says every service answers (the backend must be running)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"the {name} exited with {proc.returncode}")
            if await asyncio.to_thread(_http_status, self.port, "/ready") == 200:
                return
            await asyncio.sleep(0.2)
        raise TimeoutError("the gateway was not ready in time")

    async def wait_idle(self, timeout_s: float = 60.0, window_s: float = 0.5) -> None:
        """Until the services spend under 5% of a core over ``window_s`` (the tokenizer imports
        xgrammar in a thread after it answers): the run measures serving, not the end of a start.
        Gives up quietly after ``timeout_s`` (another process may be the one keeping them busy)."""
        deadline = time.monotonic() + timeout_s
        before = sum(self.cpu_seconds().values())
        while time.monotonic() < deadline:
            await asyncio.sleep(window_s)
            after = sum(self.cpu_seconds().values())
            if after - before < 0.05 * window_s:
                return
            before = after

    def cpu_seconds(self) -> dict[str, float]:
        import psutil

        out = {}
        for name, proc in self.procs.items():
            try:
                t = psutil.Process(proc.pid).cpu_times()
                out[name] = t.user + t.system
            except psutil.Error:
                out[name] = float("nan")
        return out

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def _http_status(port: int, path: str) -> int | None:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- the clients


def run_clients(port: int, num_streams: int, max_tokens: int, model: str, timeout_s: float) -> dict:
    """Open ``num_streams`` streaming completions at once and read them all to their end (one
    refused with a 503 is sent again).

    Returns the times (first request sent, last stream ended), and per stream its text, finish
    reasons, completion tokens (from the usage chunk) and number of SSE events."""
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    sel = selectors.DefaultSelector()
    received: list[list[bytes]] = [[] for _ in range(num_streams)]

    def open_stream(i: int) -> None:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(head + body)
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ, i)

    started = time.perf_counter()
    for i in range(num_streams):
        open_stream(i)
    open_streams, ended, num_retried = num_streams, started, 0
    deadline = started + timeout_s
    while open_streams and time.perf_counter() < deadline:
        for key, _ in sel.select(timeout=1.0):
            i = key.data
            try:
                data = key.fileobj.recv(1 << 16)
            except BlockingIOError:
                continue
            if data:
                received[i].append(data)
                continue
            sel.unregister(key.fileobj)
            key.fileobj.close()
            if received[i] and received[i][0].startswith(b"HTTP/1.1 503"):
                # what a client does: on a loaded machine the gateway may miss a service's pings
                # and refuse new requests for a moment ("retry later")
                received[i] = []
                num_retried += 1
                open_stream(i)
                continue
            open_streams -= 1
            ended = time.perf_counter()
    for key in list(sel.get_map().values()):
        key.fileobj.close()
    return {"started": started, "ended": ended, "num_unfinished": open_streams, "num_retried_503": num_retried,
            "streams": [parse_stream(b"".join(chunks)) for chunks in received]}


def parse_stream(raw: bytes) -> dict:
    """One HTTP response's SSE stream: status, text, finish reasons, usage, number of events."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line = head.split(b"\r\n", 1)[0].split()
    status = int(status_line[1]) if len(status_line) > 1 else None
    if b"transfer-encoding: chunked" in head.lower():
        body = _dechunk(body)
    text, finish, usage, num_events, done = [], [], None, 0, False
    for event in body.split(b"\n\n"):
        if not event.startswith(b"data: "):
            continue
        num_events += 1
        payload = event[len(b"data: "):]
        if payload == b"[DONE]":
            done = True
            continue
        chunk = msgspec.json.decode(payload)
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices", []):
            text.append(choice.get("text") or "")
            if choice.get("finish_reason"):
                finish.append(choice["finish_reason"])
    return {"status": status, "text": "".join(text), "finish_reasons": finish, "done": done,
            "completion_tokens": usage["completion_tokens"] if usage else 0, "num_events": num_events}


def _dechunk(body: bytes) -> bytes:
    out, pos = [], 0
    while True:
        end = body.find(b"\r\n", pos)
        if end < 0:
            break
        size = int(body[pos:end].split(b";")[0], 16)
        if size == 0:
            break
        out.append(body[end + 2:end + 2 + size])
        pos = end + 2 + size + 2
    return b"".join(out)


def _client_main(args) -> int:
    result = run_clients(args.port, args.num_streams, args.max_tokens, args.model, args.timeout)
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


# --------------------------------------------------------------------------- one run


async def run_bench(model: str, num_streams: int, max_tokens: int, step_s: float, timeout_s: float = 300.0,
                    profile_dir: str | None = None, freeze: bool = False) -> dict:
    """Start the services and the backend, run the clients' process, return what happened.
    ``freeze``: once the tokenizer is loaded, freeze this process's heap, so that no full collection
    walking transformers' objects holds the backend's steps back (the script does; a test leaves
    its own process alone)."""
    from folio.core.model_files import resolve_model
    from folio.core.tokenizer.text import TextTokenizer

    tokenizer = TextTokenizer(resolve_model(model))
    token_ids = tokenizer.hf.encode(SCRIPT_TEXT, add_special_tokens=False)
    if freeze:
        freeze_heap()
    services = Services(model, free_port(), profile_dir=profile_dir)
    ctx = zmq.asyncio.Context()
    backend = FakeBackend(ctx, services.endpoints, token_ids, step_s)
    task = asyncio.ensure_future(backend.run())
    try:
        await services.wait_ready()
        await services.wait_idle()
        meter = _cpu_meter()
        cpu_before = services.cpu_seconds()
        own_before, children_before = time.process_time(), _children_cpu()
        steps_before, late_before = backend.num_steps, backend.num_late_steps
        backend.request_times.clear()
        client = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "folio.bench.streams", "--client", "--port", str(services.port),
            "--num-streams", str(num_streams), "--max-tokens", str(max_tokens), "--model", model,
            "--timeout", str(timeout_s), stdout=asyncio.subprocess.PIPE)
        out, _ = await client.communicate()
        cpu_after = services.cpu_seconds()
        cpu_after["backend (this process)"] = time.process_time() - own_before
        cpu_after["clients"] = _children_cpu() - children_before  # the reaped client process
        cpu_before["backend (this process)"] = cpu_before["clients"] = 0.0
        result = json.loads(out)
        result["others"] = meter.lap() if meter is not None else "unmeasured"
        result["cpu_s"] = {name: cpu_after[name] - cpu_before[name] for name in cpu_after}
        result["num_steps"] = backend.num_steps - steps_before
        result["num_late_steps"] = backend.num_late_steps - late_before
        result["request_times"] = sorted(backend.request_times) or [float("nan")]
        result["expected_text"] = expected_text(tokenizer, token_ids, max_tokens)
        return result
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        backend.close()
        ctx.destroy(linger=0)
        services.stop()


def _children_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _cpu_meter():
    try:
        from folio.bench.cpu_meter import CpuMeter

        return CpuMeter()
    except ImportError:  # psutil is a test extra
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-streams", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--step-ms", type=float, default=15.0, help="the backend's step period (default 15 ms)")
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="run the gateway and tokenizer under cProfile, writing DIR/{gateway,tokenizer}.prof")
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:
        return _client_main(args)
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    result = asyncio.run(run_bench(args.model, args.num_streams, args.max_tokens, args.step_ms / 1000,
                                   args.timeout, args.profile, freeze=True))
    streams = result["streams"]
    tokens = sum(s["completion_tokens"] for s in streams)
    seconds = result["ended"] - result["started"]
    bad = [i for i, s in enumerate(streams) if s["status"] != 200 or not s["done"]
           or s["text"] != result["expected_text"] or s["completion_tokens"] != args.max_tokens]
    offered = args.num_streams * 1000 / args.step_ms
    print(f"{args.num_streams} SSE streams x {args.max_tokens} tokens, backend step every {args.step_ms:g} ms "
          f"(offers {offered:,.0f} tokens/s while all run)")
    print(f"streamed {tokens:,} tokens in {seconds:.2f} s: {tokens / seconds:,.0f} tokens/s; "
          f"{sum(s['num_events'] for s in streams):,} SSE events; {len(bad)} streams wrong or unfinished; "
          f"{result['num_retried_503']} requests sent again after a 503")
    # every stream runs max_tokens steps from its request's arrival: late arrivals stretch the run
    arrivals = [t - result["started"] for t in result["request_times"]]
    print(f"backend: {result['num_steps']} steps ({result['num_steps'] / seconds:.1f}/s), "
          f"{result['num_late_steps']} times more than a step behind; the requests reached it "
          f"{arrivals[0]:.2f} to {arrivals[-1]:.2f} s (median {arrivals[len(arrivals) // 2]:.2f} s) "
          f"after the first was sent")
    print("CPU during the run: " + ", ".join(f"{k} {v:.2f} s ({1e6 * v / max(tokens, 1):.1f} us per token)"
                                             for k, v in result["cpu_s"].items()) + f", of {seconds:.2f} s wall")
    print(f"machine: {result['others']}")
    for i in bad[:3]:
        s = streams[i]
        print(f"stream {i}: status {s['status']}, {s['num_events']} events, done {s['done']}, "
              f"{s['completion_tokens']} tokens, text {s['text'][:80]!r}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
