"""The ``folio`` command lines that README.md and docs/*.md write, read as a reader copies them, and
what a test needs to run them as a new user would: a fresh HOME and TMPDIR, and the docs'
placeholders and machine-specific values replaced (the substitution table above ``WORDS``), every flag kept as spelled.

A command line is one in a fenced block (indented ones too; ``\\`` continuations joined; leading
``VAR=value`` assignments are its environment; a trailing ``&`` and ``# comments`` dropped; ``...``
means "more flags" and is dropped), or inline code that starts with ``folio``. A line with
``[optional]`` parts is a synopsis: its flags are checked against the parser, it is not run."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKDOWN = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
FOLIO = [sys.executable, "-m", "folio.cli.main"]  # the `folio` of a command line


@dataclass(frozen=True)
class DocLine:
    where: str  # FILE:LINE
    text: str  # as written, continuations joined
    env: tuple[tuple[str, str], ...]  # its leading VAR=value assignments
    argv: tuple[str, ...]  # after `folio`
    synopsis: bool  # a usage line with [optional] parts
    block: str | None = None  # FILE:LINE of its fenced block (None: inline)

    @property
    def runnable(self) -> tuple[str, ...] | None:
        """What runs: the line itself, or a synopsis whose optional parts are flags without
        alternatives (``[--max-loras 4]``) with all of them given; None for one of alternatives
        (``[a|b]``) or of words standing for flags (``[flags]``)."""
        if not self.synopsis:
            return self.argv
        if any("|" in t or (t.startswith("[") and not t.startswith("[-")) for t in self.argv):
            return None
        return tuple(t.strip("[]") for t in self.argv)


def _logical_lines(block: str) -> list[tuple[int, str]]:
    """(offset in lines, line) with ``\\`` continuations joined, and a synopsis's indented
    ``[...]`` lines joined to it."""
    out, pending, start = [], "", 0
    for i, line in enumerate(block.splitlines()):
        if out and not pending and line[:1].isspace() and line.strip().startswith("["):
            out[-1] = (out[-1][0], f"{out[-1][1]} {line.strip()}")
            continue
        if not pending:
            start = i
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((start, pending + line))
        pending = ""
    return out


def _parse(where: str, text: str, block: str | None = None) -> DocLine | None:
    try:
        tokens = shlex.split(text, comments=True)
    except ValueError:
        return None
    env = []
    while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", tokens[0]):
        env.append(tuple(tokens.pop(0).split("=", 1)))
    if not tokens or tokens[0] != "folio":
        return None
    tokens = [t for t in tokens[1:] if t not in ("&", "...")]
    return DocLine(where, " ".join(text.split()), tuple(env), tuple(tokens), any(t.startswith("[") for t in tokens),
                   block)


def doc_lines(*command: str, files=MARKDOWN) -> list[DocLine]:
    """Every command line of ``folio COMMAND...`` in ``files`` (fenced first, then inline, per file)."""
    return [d for d in all_doc_lines(files) if d.argv[:len(command)] == command]


def block_of(line: DocLine, files=MARKDOWN) -> list[DocLine]:
    """The ``folio`` lines of ``line``'s fenced block, in order (``line`` alone when inline)."""
    return [d for d in all_doc_lines(files) if d.block == line.block] if line.block else [line]


def all_doc_lines(files=MARKDOWN) -> list[DocLine]:
    found = []
    for path in files:
        text = path.read_text()
        fence = re.compile(r"^([ \t]*)```[^\n]*\n(.*?)^\1```[ \t]*$", re.S | re.M)
        for m in fence.finditer(text):
            first = text.count("\n", 0, m.start()) + 2
            block = "\n".join(line[len(m.group(1)):] for line in m.group(2).splitlines())
            for offset, line in _logical_lines(block):
                found.append(_parse(f"{path.name}:{first + offset}", line, f"{path.name}:{first - 1}"))
        prose = fence.sub(lambda m: "\n" * m.group(0).count("\n"), text)
        for m in re.finditer(r"`(folio [^`\n]+)`", prose):
            found.append(_parse(f"{path.name}:{prose.count(chr(10), 0, m.start()) + 1}", m.group(1)))
    return [d for d in found if d is not None]


def option_strings(parser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def synopsis_flags(line: DocLine) -> list[str]:
    """The flag spellings of a synopsis (``[-tp|--tensor-parallel-size N]``: both)."""
    return [f for t in line.argv for f in re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", t)]


# --------------------------------------------------------------------------- substitution

# What the docs' placeholders and machine-specific values become in a test; every flag keeps its
# spelling. By word (a whole token, or a value inside one):
#   URL                    -> http://127.0.0.1:<a free port> (a replica nobody serves: down, the router runs on)
#   NAME                   -> docs-name (``--served-model-name NAME``)
#   N, K                   -> 4 (a count: ``--max-cpu-loras N``, ``--num-speculative-tokens K``)
#   http://collector:4318  -> http://127.0.0.1:<a free port> (an OTLP collector nobody runs: exports fail, logged)
#   /adapters/NAME         -> a tiny PEFT adapter of the tiny model, named NAME
#   /tmp/folio-X           -> a fresh run folder of its own, one per X
#   /keys                  -> a fresh key folder made by the docs' own ``folio keys init /keys ...`` line
# Port numbers (``--port P``, ``--kv-events-port P``, ``:P`` and ``_port=P`` in replica URLs) move
# by one offset, so that the ports the docs name stay apart and their relations (a snapshot port =
# the events port + 1) hold. Added to a ``folio serve`` or ``folio run router`` line where it does not
# say them: ``--port`` (a free one), ``--host 127.0.0.1``, ``--model`` (a tiny model, unless the
# test keeps the default), and for ``folio serve`` ``--run-dir`` (a fresh folder) and
# ``--num-kv-blocks 64``. Other commands (``folio keys init /keys``) get nothing added.
WORDS = {"NAME": "docs-name", "N": "4", "K": "4"}
PORT_FLAGS = ("--port", "--kv-events-port", "--kv-snapshot-port")


@dataclass
class Substitution:
    home: Path  # the fresh HOME and TMPDIR
    model: str | None  # the tiny model a `folio serve` line gets as --model (None: its own, or the default)
    router_model: str | None = None  # the same for a router line (None: as written)
    adapters: dict[str, str] = field(default_factory=dict)  # /adapters/NAME -> folder
    keys_dir: str | None = None
    offset: int = 0
    _run_dirs: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        self.offset = self.offset or port_offset()

    def port(self, text: str) -> str:
        return str(int(text) + self.offset)

    def word(self, token: str) -> str:
        if token in WORDS:
            return WORDS[token]
        if token == "URL" or token == "http://collector:4318":
            return f"http://127.0.0.1:{free_port()}"
        if token.startswith("/adapters/"):
            return self.adapters[token.removeprefix("/adapters/")]
        if token.startswith("/tmp/folio-"):
            return self._run_dirs.setdefault(token, tempfile.mkdtemp(prefix="r", dir=self.home))
        if token == "/keys":
            assert self.keys_dir, "a line names /keys: run the docs' `folio keys init /keys` line first"
            return self.keys_dir
        if "=" in token and not token.startswith("http"):  # NAME=/adapters/x (a --lora-modules item)
            name, _, value = token.partition("=")
            return f"{name}={self.word(value)}"
        if token.startswith("http://"):  # a replica spec: its ports move, its host stays
            return re.sub(r"(:|_port=)(\d+)", lambda m: m.group(1) + self.port(m.group(2)), token)
        assert not re.fullmatch(r"[A-Z][A-Z_]*", token), f"the placeholder {token} needs a substitution here"
        return token

    def argv(self, line: DocLine) -> list[str]:
        out, previous = [], None
        for token in line.runnable:
            out.append(self.port(token) if previous in PORT_FLAGS else self.word(token))
            previous = token
        added = {}
        if line.argv[0] == "serve":
            added = {"--model": self.model, "--run-dir": tempfile.mkdtemp(prefix="r", dir=self.home),
                     "--num-kv-blocks": "64"}
        if line.argv[:2] == ("run", "router"):
            added = {"--model": self.router_model}
        if added:
            added.update({"--host": "127.0.0.1", "--port": str(free_port())})
        for flag, value in added.items():
            if value is None:
                continue
            if flag not in out:
                out += [flag, value]
        return out

    def env(self, line: DocLine) -> dict[str, str]:
        return {**fresh_env(self.home), **{k: self.word(v) for k, v in line.env}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_offset(ports=(5555, 5561, 5601, 5602, 5611, 5612, 8000, 8001, 8002, 8080)) -> int:
    """An offset that puts every port the docs name on a free one (tried at random)."""
    import random

    for _ in range(100):
        offset = random.randrange(20000, 50000)
        try:
            for port in ports:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + offset))
        except OSError:
            continue
        return offset
    raise RuntimeError("no free range of ports")


# --------------------------------------------------------------------------- a fresh machine


def fresh_home() -> Path:
    """A new user's HOME, also their TMPDIR: short, since ipc:// paths must stay under ~100 bytes."""
    return Path(tempfile.mkdtemp(prefix="fh", dir="/tmp"))


def fresh_env(home: Path) -> dict[str, str]:
    """This environment as a new user's shell has it: no FOLIO_ setting, the caches under ``home``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FOLIO_", "PYTEST", "XDG_")) and k not in ("HF_HOME", "TMP", "TEMP")}
    return {**env, "HOME": str(home), "TMPDIR": str(home)}


def run_folder(home: Path, port: int) -> Path:
    """The run folder a service on HTTP ``port`` makes in a fresh TMPDIR (``default_run_dir``)."""
    return home / f"folio-{port}"


def folio(argv: list[str], env: dict[str, str], timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*FOLIO, *argv], env=env, capture_output=True, text=True, timeout=timeout_s)


def start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen([*FOLIO, *argv], env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def wait_for(check, proc: subprocess.Popen, log: Path, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        if proc.poll() is not None:
            raise AssertionError(f"{what}: exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.5)
    raise AssertionError(f"{what}: not up within {timeout_s:.0f} s:\n{log.read_text(errors='replace')[-3000:]}")


def http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def stop(proc: subprocess.Popen, *, group: bool = True, wait_s: float = 40) -> None:
    """SIGTERM to the command's process group (``group``; else to the command alone: a ``folio
    serve`` stops its services, which run in sessions of their own), up to ``wait_s`` for it to
    end, then SIGKILL to the group and to whatever of its tree is left."""
    import psutil

    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    if proc.poll() is None:
        try:
            if group:
                os.killpg(proc.pid, signal.SIGTERM)
            else:
                proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)
    for child in tree:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(tree, timeout=30)


def remove(home: Path) -> None:
    shutil.rmtree(home, ignore_errors=True)
