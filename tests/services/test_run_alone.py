"""``folio run SERVICE`` alone, as a new user runs it: a fresh HOME and TMPDIR, no FOLIO_ setting.

Each service makes its own run folder (0700, as ``folio serve`` does) and answers ``folio health
NAME`` on its admin socket; a gateway or router on ``--port P`` uses the folder of P, where
``folio router stats --port P`` looks. The router starts from the exact lines of
docs/operations.md (read from the page, so a line that stops starting fails here), each after the
lines of its block before it: on a fresh HOME it prepares the default model for its tokenizer and
makes the host's key folder itself."""

from __future__ import annotations

import json
import stat
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.services.doc_commands import (
    Substitution,
    block_of,
    doc_lines,
    folio,
    fresh_env,
    fresh_home,
    free_port,
    http_status,
    option_strings,
    remove,
    run_folder,
    start,
    stop,
    synopsis_flags,
    wait_for,
)


def is_private(folder) -> bool:
    return folder.is_dir() and stat.S_IMODE(folder.stat().st_mode) == 0o700


def router_lines():
    """The router's command lines in docs/operations.md that run (a bare mention names the command)."""
    return [line for line in doc_lines("run", "router") if len(line.argv) > 2 and line.where.startswith("operations.md")]


def test_a_service_alone_on_a_fresh_machine_makes_its_run_folder():
    home = fresh_home()
    env = fresh_env(home)
    proc = start(["run", "kvmanager"], env, home / "kvmanager.log")
    try:
        wait_for(lambda: folio(["health", "kvmanager", "--timeout", "0.5"], env).returncode == 0, proc,
                 home / "kvmanager.log", "folio run kvmanager", 60)
        assert is_private(run_folder(home, 8000))  # port 8000's folder in TMPDIR, 0700
    finally:
        stop(proc)
        remove(home)


def test_the_documented_router_lines_parse():
    from folio.services.router.main import check
    from folio.shared.flags import service_parser

    parser = service_parser("router", "")
    home = fresh_home()
    try:
        sub = Substitution(home, model=None, keys_dir="/keys")
        for line in router_lines():
            if line.synopsis:
                assert [f for f in synopsis_flags(line) if f not in option_strings(parser)] == [], line.where
                continue
            check(parser, parser.parse_args(sub.argv(line)[2:]))  # parser.error exits: the test fails
    finally:
        remove(home)
    assert any("--port" in line.argv and "--replica" in line.argv for line in router_lines())
    assert any("--prefill" in line.argv for line in router_lines())


# --------------------------------------------------------------------------- slow: processes


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm_tokenizer_dir) -> str:
    from folio.testing.models import write_tiny_chat_model

    return write_tiny_chat_model(tmp_path_factory.mktemp("tiny-alone"), smollm_tokenizer_dir)


@pytest.mark.slow  # six services, each its own Python: about 50 s on a busy 2-core machine
@pytest.mark.timeout(600)
def test_every_service_starts_alone_on_a_fresh_machine(tiny):
    home = fresh_home()
    env = fresh_env(home)
    gateway_port, router_port = free_port(), free_port()
    commands = {"kvmanager": [], "scheduler": [], "tokenizer": ["--model", tiny],
                "executor": ["--model", tiny, "--num-kv-blocks", "64"],
                "gateway": ["--port", str(gateway_port), "--host", "127.0.0.1"],
                "router": ["--port", str(router_port), "--host", "127.0.0.1", "--model", tiny,
                           "--replica", f"http://127.0.0.1:{gateway_port}"]}
    where = {"gateway": ["--port", str(gateway_port)], "router": ["--port", str(router_port)]}
    procs = {name: start(["run", name, *flags], env, home / f"{name}.log") for name, flags in commands.items()}
    try:
        for name, proc in procs.items():
            wait_for(lambda: folio(["health", name, *where.get(name, []), "--timeout", "0.5"], env).returncode == 0,
                     proc, home / f"{name}.log", f"folio run {name}", 300)
        assert all(is_private(run_folder(home, port)) for port in (8000, gateway_port, router_port))
        stats = json.loads(folio(["router", "stats", "--port", str(router_port), "--json"], env).stdout)
        assert stats["num_replicas"] == 1
    finally:
        for proc in procs.values():
            stop(proc)
        remove(home)


def run_block(sub: Substitution, line, home) -> tuple[list, dict]:
    """The lines of ``line``'s block before it (key folders made, servers started), then ``line``:
    (the processes started, the router's argv)."""
    procs = []
    for before in block_of(line):
        argv = sub.argv(before)
        if before == line:
            procs.append(start(argv, sub.env(before), home / f"router-{line.where.replace(':', '-')}.log"))
            return procs, argv
        if before.argv[0] == "serve":
            procs.append(start(argv, sub.env(before), home / f"serve-{argv[argv.index('--port') + 1]}.log"))
        else:
            made = folio(argv, sub.env(before))
            assert made.returncode == 0, f"{before.where}: {before.text}: {made.stderr}"
    raise AssertionError("a line is in its own block")


def routes_a_request(port: int) -> bool:
    models = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10).read())
    body = {"model": models["data"][0]["id"], "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.status == 200 and json.loads(r.read())["choices"][0]["finish_reason"] is not None


@pytest.mark.slow  # the default model prepared on a fresh HOME, two replicas: minutes
@pytest.mark.timeout(1200)
def test_the_router_starts_from_the_lines_of_the_docs_on_a_fresh_machine(tiny):
    """All the documented router lines at once on one fresh machine, so that their routers prepare
    the default model together; the "On one machine" block then routes a request to its replicas."""
    home = fresh_home()
    sub = Substitution(home, model=tiny, keys_dir=str(home / "keys"))
    lines = [line for line in router_lines() if not line.synopsis]
    started = [run_block(sub, line, home) for line in lines]
    env = fresh_env(home)
    try:
        for line, (procs, argv) in zip(lines, started):
            port = argv[argv.index("--port") + 1]
            log = home / f"router-{line.where.replace(':', '-')}.log"
            wait_for(lambda: folio(["health", "router", "--port", port, "--timeout", "0.5"], env).returncode == 0,
                     procs[-1], log, f"{line.where}: {line.text}", 900)
            assert is_private(run_folder(home, int(port)))
            if "--replica" in line.argv:  # the replicas of its block come up behind it and answer through it
                wait_for(lambda: http_status(f"http://127.0.0.1:{port}/health") == 200, procs[-1], log,
                         f"{line.where}: its replicas", 600)
                stats = lambda: json.loads(folio(["router", "stats", "--port", port, "--json"], env).stdout)  # noqa: E731
                wait_for(lambda: stats()["num_replicas_up"] == 2, procs[-1], log, "both replicas up", 600)
                assert routes_a_request(int(port))
    finally:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(stop, [p for procs, _ in started for p in procs]))
        remove(home)
