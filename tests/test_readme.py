"""README.md is a map, and the map is right.

- The README stays short (at most about 250 lines) and opens with a quick-start block of two commands.
- Every script the README or a page of docs/ names exists, and so does every path it quotes.
- Every relative link in README.md and docs/*.md points to an existing file (and heading).
- Slow: the quick-start commands run as written on a fresh clone of the committed HEAD. The serve
  command sets up its own .venv and serves (on a free port); one chat completion answers over HTTP;
  the test command sets up the test extras and runs one test file's check.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.services.doc_commands import stop as stop_tree

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 250
# What the test command runs inside the clone: the layout checks, so that it cannot run this file again.
TEST_COMMAND_ARGS = "tests/test_layout.py"


def quick_start_commands(text: str) -> list[str]:
    """The commands of the first fenced block under the ``## Quick start`` heading, comments dropped."""
    m = re.search(r"^## Quick start\n(?P<before>.*?)^```\w*\n(?P<block>.*?)^```", text, re.S | re.M)
    assert m, "README.md has no fenced block under '## Quick start'"
    assert not re.search(r"^#", m.group("before"), re.M), "the quick-start block must come before any other heading"
    commands = [line.split("#", 1)[0].strip() for line in m.group("block").splitlines()]
    return [c for c in commands if c]


def the_command(commands: list[str], script: str) -> str:
    found = [c for c in commands if c.split()[:2] == ["bash", f"scripts/{script}"]]
    assert len(found) == 1, f"the quick-start block should hold one 'bash scripts/{script}': {commands}"
    return found[0]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)  # no headings inside code
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*)$", text, re.M)}


def markdown_files() -> list[Path]:
    return [README, *DOCS]


# --- fast checks ---------------------------------------------------------------------------------------


def test_the_readme_is_a_map():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move depth into docs/"
    assert DOCS, "docs/ holds the depth the README links to"


def test_the_quick_start_block_holds_the_two_commands():
    commands = quick_start_commands(README.read_text())
    assert the_command(commands, "serve.sh") == "bash scripts/serve.sh"
    assert the_command(commands, "test.sh") == "bash scripts/test.sh"


def test_quick_start_parser_reads_only_the_block_under_its_heading():
    text = "# x\n\n## Quick start\n\nSome words.\n\n```bash\nbash scripts/a.sh  # note\n\nbash scripts/b.sh\n```\n\n```\nno\n```\n"
    assert quick_start_commands(text) == ["bash scripts/a.sh", "bash scripts/b.sh"]
    with pytest.raises(AssertionError):
        quick_start_commands("## Quick start\n\n## Other\n\n```\nbash scripts/a.sh\n```\n")


def test_every_script_named_exists():
    named = {}
    for f in markdown_files():
        for m in re.finditer(r"\b(?:bash|python3?)\s+(scripts/[\w./-]+)", f.read_text()):
            named.setdefault(m.group(1), f.name)
    assert "scripts/serve.sh" in named and "scripts/test.sh" in named
    missing = {path: where for path, where in named.items() if not (ROOT / path).is_file()}
    assert missing == {}


def test_every_quoted_repository_path_exists():
    """A path in backticks under one of the repository's folders names a file or folder that exists."""
    tops = ("folio/", "services/", "shared/", "cuda/", "scripts/", "tests/", "deploy/", "docs/")
    missing = []
    for f in markdown_files():
        for m in re.finditer(r"`([^`\s]+)`", f.read_text()):
            path = m.group(1).rstrip("/,;:.")
            if not path.startswith(tops) or any(c in path for c in "<>*{}"):
                continue
            if (ROOT / path).exists():
                continue
            ignored = any(subprocess.run(["git", "check-ignore", "-q", p], cwd=ROOT).returncode == 0
                          for p in (path, path + "/"))
            if not ignored:
                missing.append(f"{f.name}: {path}")
    assert missing == []


def broken_links(files: list[Path]) -> list[str]:
    broken = []
    for f in files:
        text = re.sub(r"^```.*?^```", "", f.read_text(), flags=re.S | re.M)
        for m in re.finditer(r"\]\(([^)\s]+)\)", text):
            target = m.group(1)
            if re.match(r"^[a-z]+:", target):
                continue  # http:, https:, mailto:
            path_part, _, anchor = target.partition("#")
            dest = (f.parent / path_part).resolve() if path_part else f
            if not dest.exists():
                broken.append(f"{f.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{f.name}: {target} (no such heading)")
    return broken


def test_every_relative_link_resolves():
    assert broken_links(markdown_files()) == []


def test_the_link_checker_sees_a_broken_link(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## `folio quantize`\n")
    page = tmp_path / "page.md"
    page.write_text("## A heading\n\n[ok](#a-heading) [ok](other.md#folio-quantize) [web](https://x.org/y)\n"
                    "[bad](#b) [gone](nothing.md) [bad](other.md#nope)\n\n```\n[in code](nowhere.md)\n```\n")
    assert broken_links([page]) == ["page.md: #b (no such heading)", "page.md: nothing.md (no such file)",
                                    "page.md: other.md#nope (no such heading)"]
    assert slug("Faults, deadlines and limits") == "faults-deadlines-and-limits"


# --- the slow one: the quick start on a fresh clone ----------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env() -> dict[str, str]:
    """The environment of a new shell: no virtualenv or pytest settings leak from this run. The model
    cache is the suite's own, so that the clone's setup finds the converted model."""
    from folio.shared.config import cache_dir

    venv_bin = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "FOLIO_RUN_DIR") and not k.startswith("PYTEST")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != venv_bin)
    env["FOLIO_CACHE_DIR"] = str(cache_dir())
    return env


def tail(path: Path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


def post_json(url: str, body: dict, timeout: float) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {"error": e.read().decode(errors="replace")}


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, deadline_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < deadline_s:
        if proc.poll() is not None:
            pytest.fail(f"the serve command exited with {proc.returncode} before /health answered:\n{tail(log)}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - start
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(2)
    pytest.fail(f"/health did not answer 200 within {deadline_s:.0f} s:\n{tail(log)}")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the launcher alone (it stops its services, which run in sessions of their own),
    then SIGKILL to its process group and to anything of its tree still alive."""
    stop_tree(proc, group=False, wait_s=60)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_quick_start_runs_as_written_on_a_fresh_clone(tmp_path):
    """The README's two commands on a clone of the committed HEAD: each sets up the clone's own .venv
    (pip from the local package index), the first serves, the second tests. Takes minutes."""
    commands = quick_start_commands(README.read_text())
    serve, test = the_command(commands, "serve.sh"), the_command(commands, "test.sh")
    clone = tmp_path / "folio"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=300)
    env = clean_env()
    started = time.monotonic()

    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        # as written, on a free port (extra flags go to `folio serve`): port 8000 may be taken here
        proc = subprocess.Popen(f"{serve} --port {port}", shell=True, cwd=clone, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        up_s = wait_healthy(f"http://127.0.0.1:{port}/health", proc, log, deadline_s=1800)
        assert (clone / ".venv" / "bin" / "folio").exists(), "the serve command set up the clone's own .venv"
        status, body = post_json(f"http://127.0.0.1:{port}/v1/chat/completions", {
            "model": "SmolLM2-135M-Instruct", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "Name three rivers."}]}, timeout=300)
        assert status == 200, body
        text = body["choices"][0]["message"]["content"]
        assert isinstance(text, str) and text.strip(), body
    finally:
        stop(proc)
        shutil.rmtree(Path(tempfile.gettempdir(), f"folio-{port}"), ignore_errors=True)  # that port's default run folder
    served_s = time.monotonic() - started

    r = subprocess.run(f"{test} {TEST_COMMAND_ARGS}", shell=True, cwd=clone, env=env, capture_output=True,
                       text=True, timeout=2400)
    output = r.stdout + r.stderr
    assert r.returncode == 0, output[-4000:]
    assert re.search(r"\b[1-9]\d* passed\b", output), output[-4000:]
    assert not re.search(r"\b\d+ (failed|error)", output), output[-4000:]
    shutil.rmtree(clone, ignore_errors=True)  # its .venv is a few GB; a failed run keeps it to look at
    print(f"fresh clone: serving after {up_s:.0f} s, serve part {served_s:.0f} s, "
          f"whole test {time.monotonic() - started:.0f} s")
