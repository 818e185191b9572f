"""Every ``folio serve`` command line that README.md and docs/*.md write starts a server.

Fast: each line (placeholders replaced as the table in ``doc_commands`` says, every flag as
spelled) goes through the real ``folio serve`` argument parser and ``speculative_refusal``, and
every flag of a synopsis is one the parser takes. Slow: each distinct line starts, as a new user
would (a fresh HOME and TMPDIR), on a tiny model, until ``/health`` answers 200."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.services.doc_commands import (
    Substitution,
    doc_lines,
    fresh_home,
    http_status,
    option_strings,
    remove,
    start,
    stop,
    synopsis_flags,
    wait_for,
)

# Lines that cannot start on a CPU test machine, each with its reason. Nothing else is skipped.
CANNOT_RUN_ON_A_CPU: dict[str, str] = {
    "folio serve --device cuda": "needs a CUDA device (the served stage of scripts/gpu_check.sh runs it on one)",
}
ADAPTERS = ("sql", "notes")  # the names /adapters/NAME takes in the docs


def serve_lines():
    """The distinct runnable lines (the first place each is written)."""
    seen, out = set(), []
    for line in doc_lines("serve"):
        if line.runnable is not None and (line.runnable, line.env) not in seen:
            seen.add((line.runnable, line.env))
            out.append(line)
    return out


def test_the_reader_finds_lines_as_a_reader_copies_them(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Run `folio serve --port 1`, not `folio chat` or `folio serve [flags]`.\n\n- a list:\n\n  ```\n"
                    "  X=1 folio serve --a \\\n      --b 2 &   # note\n  folio keys init /keys\n  ```\n\n"
                    "```\nfolio serve [--c N] [--d x|y]\n  [-e|--eee]\n```\n")
    found = doc_lines("serve", files=[page])
    assert [(d.where, d.env, d.argv, d.synopsis) for d in found] == [
        ("page.md:6", (("X", "1"),), ("serve", "--a", "--b", "2"), False),
        ("page.md:12", (), ("serve", "[--c", "N]", "[--d", "x|y]", "[-e|--eee]"), True),
        ("page.md:1", (), ("serve", "--port", "1"), False), ("page.md:1", (), ("serve", "[flags]"), True)]
    assert found[1].runnable is None and synopsis_flags(found[1]) == ["--c", "--d", "-e", "--eee"]
    assert found[3].runnable is None and found[0].runnable == found[0].argv
    sub = Substitution(tmp_path, model="/m", keys_dir="/k")
    argv = sub.argv(found[2])
    assert argv[:2] == ["serve", "--port"] and int(argv[2]) == 1 + sub.offset and argv[argv.index("--model") + 1] == "/m"
    with pytest.raises(AssertionError, match="placeholder DIR"):
        sub.word("DIR")


def test_every_documented_serve_line_parses_and_is_not_refused():
    from folio.cli.main import build_parser
    from folio.core.executor.runtime.spec_config import speculative_refusal

    parser = build_parser()
    home = fresh_home()
    try:
        sub = Substitution(home, model=None, adapters={a: f"/adapters/{a}" for a in ADAPTERS}, keys_dir="/keys")
        refused = []
        for line in serve_lines():
            try:
                args = parser.parse_args(sub.argv(line))
            except SystemExit:
                refused.append(f"{line.where}: {line.text}: the parser refused it")
                continue
            if speculative_refusal(args):
                refused.append(f"{line.where}: {line.text}: {speculative_refusal(args)}")
    finally:
        remove(home)
    assert refused == []
    spellings = {line.runnable[1:] for line in serve_lines()}
    assert ("--speculative-model", "ngram", "--num-speculative-tokens", "4") in spellings  # the older flags


def test_each_line_left_out_on_a_cpu_is_still_documented():
    written = {line.text for line in serve_lines()}
    assert set(CANNOT_RUN_ON_A_CPU) <= written, set(CANNOT_RUN_ON_A_CPU) - written


def test_every_flag_of_a_serve_synopsis_is_one_folio_serve_takes():
    from folio.cli.main import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    synopses = [line for line in doc_lines("serve") if line.synopsis]
    assert synopses, "docs/operations.md writes folio serve's synopsis"
    unknown = [f"{line.where}: {flag}" for line in synopses for flag in synopsis_flags(line)
               if flag not in option_strings(serve)]
    assert unknown == []


# --------------------------------------------------------------------------- slow: each starts


@pytest.fixture(scope="module")
def machine(tmp_path_factory, smollm_tokenizer_dir):
    """A fresh HOME and TMPDIR, a tiny model, its adapters, and /keys made by the docs' own lines."""
    from folio.testing.peft_adapters import write_peft_adapter
    from folio.testing.models import write_tiny_chat_model
    from tests.services.doc_commands import folio

    model = write_tiny_chat_model(tmp_path_factory.mktemp("tiny-docs"), smollm_tokenizer_dir)
    adapters = {name: write_peft_adapter(model, tmp_path_factory.mktemp(f"adapter-{name}"), 8,
                                         ["q_proj", "v_proj"], seed=i) for i, name in enumerate(ADAPTERS)}
    home = fresh_home()
    sub = Substitution(home, model=model, adapters=adapters, keys_dir=str(home / "keys"))
    for line in doc_lines("keys", "init", "/keys"):
        made = folio(sub.argv(line), sub.env(line))
        assert made.returncode == 0, f"{line.where}: {line.text}: {made.stderr}"
    yield sub
    remove(home)


def start_until_healthy(sub: Substitution, line) -> str | None:
    """None once ``/health`` said 200 (then stopped), else what went wrong."""
    argv = sub.argv(line)
    port = argv[argv.index("--port") + 1]
    log = sub.home / f"serve-{port}.log"
    proc = start(argv, sub.env(line), log)
    try:
        wait_for(lambda: http_status(f"http://127.0.0.1:{port}/health") == 200, proc, log, line.text, 300)
    except AssertionError as exc:
        return f"{line.where}: {exc}"
    finally:
        stop(proc)
    return None


@pytest.mark.slow  # a dozen servers, three at a time: minutes
@pytest.mark.timeout(1800)
def test_every_documented_serve_line_starts_a_server(machine):
    lines = [line for line in serve_lines() if line.text not in CANNOT_RUN_ON_A_CPU]
    assert len(lines) >= 10
    with ThreadPoolExecutor(3) as pool:
        failures = [f for f in pool.map(lambda line: start_until_healthy(machine, line), lines) if f]
    assert failures == []
