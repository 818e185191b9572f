"""``folio``: serve starts the five services as processes and stops them cleanly; a child that
dies is restarted (with ``--no-restart``: reported, which and why, and the rest stopped); run
folders are claimed atomically and are per port by default; flags reach the services that own them."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from folio.cli.main import main as folio
from folio.shared.transport import ask_service
from folio.services.serve import SERVICES, add_serve_args, service_argv
from folio.shared.config import Endpoints
from folio.services.in_process import short_run_dir
from folio.testing.models import write_tiny_chat_model

STARTUP_TIMEOUT_S = 90


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory, smollm_tokenizer_dir) -> str:
    return write_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"), smollm_tokenizer_dir)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    def __init__(self, model: str, *flags: str, run_dir: str | None = None):
        self.port = free_port()
        self.run_dir = run_dir or short_run_dir()
        where = ["--run-dir", self.run_dir] if run_dir != "default" else []
        if run_dir == "default":
            self.run_dir = str(Path(tempfile.gettempdir(), f"folio-{self.port}"))  # default_run_dir, unset
        cmd = [sys.executable, "-m", "folio.cli.main", "serve", "--model", model, *where,
               "--host", "127.0.0.1", "--port", str(self.port), "--num-kv-blocks", "64", "--dtype", "float32",
               "--block-size", "8", "--max-num-seqs", "8", *flags]
        self.log = tempfile.TemporaryFile("a+")  # children share it: appends only; a pipe could fill and block
        env = {k: v for k, v in os.environ.items() if k != "FOLIO_RUN_DIR"}
        self.proc = subprocess.Popen(cmd, stderr=self.log, env=env)
        self.endpoints = Endpoints.ipc(self.run_dir)

    def children(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        waiting = set(SERVICES)
        while waiting and time.monotonic() < deadline:
            assert self.proc.poll() is None, self.stderr()
            waiting = {s for s in waiting if ask_service(self.endpoints, s, "ping", {}, 0.5) is None}
        assert not waiting, f"not answering: {waiting}"
        while ask_service(self.endpoints, "kvmanager", "stats", {}, 1).data["registered"] is False:
            time.sleep(0.1)
        wait_healthy(self.port)  # the gateway's own probes saw them all

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def finish(self, timeout_s: float = 30) -> tuple[int, str]:
        try:
            self.proc.wait(timeout=timeout_s)
        finally:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        return self.proc.returncode, self.stderr()


def test_serve_answers_then_stops_cleanly_on_sigterm(tiny_chat_model, capsys):
    serve = Serve(tiny_chat_model)
    try:
        serve.wait_ready()
        children = serve.children()
        assert len(children) == len(SERVICES)
        for service in SERVICES:  # each froze what its imports and setup left (a full collection of it
            # stalled the executor's steps for up to 210 ms)
            assert ask_service(serve.endpoints, service, "ping", {}, 5).data["gc_frozen"] > 10_000, service
        with urllib.request.urlopen(f"http://127.0.0.1:{serve.port}/v1/models", timeout=30) as resp:
            model_name = json.load(resp)["data"][0]["id"]
        body = json.dumps({"model": model_name, "prompt": "Hello", "max_tokens": 5, "temperature": 0}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{serve.port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as resp:
            assert json.load(resp)["usage"]["completion_tokens"] == 5
        for _ in range(100):  # a finished request's blocks go back in the scheduler's next step
            assert folio(["kv", "stats", "--json", "--run-dir", serve.run_dir]) == 0
            kv = json.loads(capsys.readouterr().out)
            if kv["num_blocks_used"] == 0:
                break
            time.sleep(0.05)
        assert kv["num_blocks_total"] == 64 and kv["num_blocks_used"] == 0 and kv["block_size"] == 8
        assert folio(["kv", "blocks", "--run-dir", serve.run_dir]) == 0
        assert "device:" in capsys.readouterr().out
        assert folio(["kv", "clear", "--json", "--run-dir", serve.run_dir]) == 0
        assert json.loads(capsys.readouterr().out)["num_blocks_dropped"] == kv["num_blocks_cached"]
        assert folio(["scheduler", "stats", "--run-dir", serve.run_dir]) == 0
        assert "num_generation_tokens_total" in capsys.readouterr().out
        for _ in range(50):  # the readiness line comes from a side thread polling the services
            if "folio: ready at http://127.0.0.1:" in serve.stderr():
                break
            time.sleep(0.1)
        assert f"folio: ready at http://127.0.0.1:{serve.port}/v1" in serve.stderr()
        # a second serve on the same run folder refuses instead of stealing the sockets
        other = subprocess.run([sys.executable, "-m", "folio.cli.main", "serve", "--model", tiny_chat_model,
                                "--run-dir", serve.run_dir], capture_output=True, text=True, timeout=60)
        assert other.returncode == 1 and f"another folio (pid {serve.proc.pid}) is serving" in other.stderr
        serve.proc.send_signal(signal.SIGTERM)
        code, err = serve.finish()
    finally:
        if serve.proc.poll() is None:
            serve.proc.kill()
    assert code == 0, err
    assert "SIGTERM received, stopping the services" in err and "Traceback" not in err
    assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)


@pytest.mark.slow  # about 6 s
def test_serve_without_restarts_says_which_child_died_and_stops_the_others(tiny_chat_model):
    serve = Serve(tiny_chat_model, "--no-restart")
    try:
        serve.wait_ready()
        children = {c.cmdline()[4]: c for c in serve.children()}  # python -m folio.cli.main run NAME
        children["executor"].send_signal(signal.SIGKILL)
        code, err = serve.finish()
    finally:
        if serve.proc.poll() is None:
            serve.proc.kill()
    assert code == 1
    assert "the executor service was killed by SIGKILL; stopping the others" in err
    for name, child in children.items():
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, name


def test_each_service_accepts_the_flags_serve_forwards(tiny_chat_model, monkeypatch):
    import argparse

    from folio.services.executor.main import parse_config as executor_config
    from folio.services.gateway.main import parse_config as gateway_config
    from folio.services.kvmanager.main import parse_config as kvmanager_config
    from folio.services.scheduler.main import parse_config as scheduler_config
    from folio.services.tokenizer.main import parse_config as tokenizer_config

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--model", tiny_chat_model, "--port", "9001", "--max-num-seqs", "3",
                              "--max-num-batched-tokens", "99", "--max-model-len", "200", "--block-size", "8",
                              "--num-kv-blocks", "40", "--log-json", "--served-model-name", "tiny",
                              "--preemption-mode", "swap", "--no-enable-chunked-prefill",
                              "--scheduling-policy", "priority", "--long-prefill-token-threshold", "64",
                              "--speculative-model", "ngram", "--num-speculative-tokens", "3",
                              "--ngram-prompt-lookup-max", "5", "--log-level", "warning", "--enforce-eager"])
    argv = {name: service_argv(name, args, tiny_chat_model) for name in SERVICES}
    monkeypatch.setenv("FOLIO_RUN_DIR", "/tmp/folio-flags")
    ex = executor_config(argv["executor"])
    assert (ex.runtime.block_size, ex.runtime.num_kv_blocks, ex.runtime.max_num_seqs) == (8, 40, 3)
    assert ex.model_path == tiny_chat_model and ex.log_json
    assert (ex.runtime.speculative_model, ex.runtime.num_speculative_tokens) == ("ngram", 3)
    assert ex.runtime.ngram_prompt_lookup_max == 5
    assert ex.runtime.enforce_eager
    assert not executor_config(["--model", tiny_chat_model]).runtime.enforce_eager  # graphs by default
    sc = scheduler_config(argv["scheduler"])
    assert (sc.max_num_seqs, sc.max_num_batched_tokens, sc.max_model_len) == (3, 99, 200)
    assert (sc.preemption_mode, sc.enable_chunked_prefill, sc.scheduling_policy) == ("swap", False, "priority")
    assert sc.long_prefill_token_threshold == 64
    assert all("--log-level" in argv[name] for name in SERVICES)  # every service logs at the asked level
    assert kvmanager_config(argv["kvmanager"]).log_json
    gw = gateway_config(argv["gateway"])
    assert (gw.port, gw.model_name) == (9001, "tiny")
    assert tokenizer_config(argv["tokenizer"]).max_model_len == 200


def test_admin_commands_report_a_missing_service(capsys):
    run_dir = short_run_dir()
    try:
        assert folio(["kv", "stats", "--run-dir", run_dir, "--timeout", "0.2"]) == 1
        assert "did not answer" in capsys.readouterr().err
        assert folio(["health", "scheduler", "--run-dir", run_dir, "--timeout", "0.2"]) == 1
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def completion(port: int, prompt: str = "Hello", max_tokens: int = 5, timeout_s: float = 60) -> dict:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as resp:
        return json.load(resp)


def wait_healthy(port: int, timeout_s: float = STARTUP_TIMEOUT_S) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                return json.load(resp)
        except OSError:
            time.sleep(0.2)
    raise AssertionError("/health never said 200")


@pytest.mark.slow  # over 8 s: the full suite only
def test_serve_restarts_a_dead_service_and_health_tells_the_truth(tiny_chat_model):
    serve = Serve(tiny_chat_model, "--max-restarts", "1")
    try:
        serve.wait_ready()
        assert wait_healthy(serve.port)["status"] == "ok"
        before = completion(serve.port)["choices"][0]["text"]
        children = {c.cmdline()[4]: c for c in serve.children()}
        children["tokenizer"].send_signal(signal.SIGKILL)
        # within the probe deadline /health names the dead service, and a request gets 503 at once
        deadline = time.monotonic() + 5
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{serve.port}/health", timeout=2).close()
            except urllib.error.HTTPError as exc:
                body = json.load(exc)
                if exc.code == 503 and "tokenizer" in body["down"]:
                    break
            assert time.monotonic() < deadline, "/health did not notice the dead tokenizer"
            time.sleep(0.1)
        assert wait_healthy(serve.port, 60)["status"] == "ok"  # restarted
        assert completion(serve.port)["choices"][0]["text"] == before
        assert "the tokenizer service was killed by SIGKILL; restarting it" in serve.stderr()
        assert folio(["health", "tokenizer", "--run-dir", serve.run_dir, "--timeout", "2"]) == 0
        # a second death within the minute passes --max-restarts 1: everything stops, with a message
        [child for child in serve.children() if child.cmdline()[4] == "tokenizer"][0].send_signal(signal.SIGKILL)
        code, err = serve.finish()
    finally:
        if serve.proc.poll() is None:
            serve.proc.kill()
    assert code == 1
    assert "its 2th death within 60s (--max-restarts 1); stopping everything" in err


@pytest.mark.slow  # over 8 s: the full suite only
def test_two_servers_on_two_ports_run_side_by_side_and_a_folder_is_claimed_once(tiny_chat_model, capsys):
    first, second = Serve(tiny_chat_model, run_dir="default"), Serve(tiny_chat_model, run_dir="default")
    try:
        for serve in (first, second):
            serve.wait_ready()
            assert completion(serve.port)["usage"]["completion_tokens"] == 5
        # the admin CLI finds each by its port
        for serve in (first, second):
            assert folio(["gateway", "stats", "--json", "--port", str(serve.port)]) == 0
            assert json.loads(capsys.readouterr().out)["num_requests"] == 1
        # two servers started at the same instant on one folder: exactly one claims it
        race_dir = short_run_dir()
        cmd = [sys.executable, "-m", "folio.cli.main", "serve", "--model", tiny_chat_model, "--run-dir", race_dir,
               "--host", "127.0.0.1", "--num-kv-blocks", "16", "--dtype", "float32"]
        racers = [subprocess.Popen([*cmd, "--port", str(free_port())], stderr=subprocess.PIPE, text=True)
                  for _ in range(2)]
        loser = None
        deadline = time.monotonic() + 60
        while loser is None and time.monotonic() < deadline:
            loser = next((r for r in racers if r.poll() is not None), None)
            time.sleep(0.05)
        winner = next(r for r in racers if r is not loser)
        assert loser is not None and loser.returncode == 1
        assert "is serving in" in loser.stderr.read()
        assert winner.poll() is None
        winner.send_signal(signal.SIGTERM)
        assert winner.wait(timeout=30) == 0
        shutil.rmtree(race_dir, ignore_errors=True)
    finally:
        for serve in (first, second):
            if serve.proc.poll() is None:
                serve.proc.send_signal(signal.SIGTERM)
        for serve in (first, second):
            assert serve.finish()[0] == 0
