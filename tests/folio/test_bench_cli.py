"""``folio bench NAME``: runs the benchmark module ``folio.bench.NAME`` with its own flags, as
``python -m folio.bench.NAME`` and the checkout's ``scripts/bench_NAME.py`` entry point do, and prints
one summary block in the shared format (JSON with ``--save-result``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from folio.cli import bench
from folio.cli.main import main as folio_main

ROOT = Path(__file__).resolve().parents[2]

FAKE = '''"""A benchmark that prints two figures."""
import argparse
import sys

from fakebench.helper_mod import FACTOR  # the benchmarks import their neighbours from the package

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, required=True)
p.add_argument("--fail", action="store_true")


def main(argv=None):
    args = p.parse_args(argv)
    print(f"ran {args.steps} steps (argv {sys.argv[1:]})")
    print(f"host ms/step at B=256: {args.steps * FACTOR}")
    print("served/static = 1.9x")
    if args.fail:
        raise SystemExit(3)
'''


def test_every_benchmark_is_a_subcommand_and_has_its_script(capsys):
    assert folio_main(["bench", "list"]) == 0
    out = capsys.readouterr().out
    names = sorted(p.stem for p in (ROOT / "folio" / "bench").glob("*.py") if "\ndef main(" in p.read_text())
    assert len(names) >= 12
    listed = [line.split()[0] for line in out.splitlines() if line.strip()]
    assert listed == names  # ``serve`` among them: folio bench serve is folio.bench.serve
    # each keeps its checkout entry point: a few lines calling the package's main
    scripts = {p.stem.removeprefix("bench_"): p for p in (ROOT / "scripts").glob("*.py")}
    assert sorted(scripts) == names
    for name, path in scripts.items():
        text = path.read_text()
        assert f"from folio.bench.{name} import main" in text and len(text.splitlines()) <= 12, path


def test_a_benchmark_runs_with_its_flags_and_the_shared_summary(tmp_path, monkeypatch, capsys):
    package = tmp_path / "fakebench"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "fake.py").write_text(FAKE)
    (package / "helper_mod.py").write_text("FACTOR = 0.5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(bench, "PACKAGE", "fakebench")
    argv_before = list(sys.argv)
    result = tmp_path / "r.json"
    assert folio_main(["bench", "list"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == ["fake"]  # not helper_mod
    assert folio_main(["bench", "fake", "--steps", "8", "--save-result", str(result)]) == 0
    out = capsys.readouterr().out
    assert "ran 8 steps (argv ['--steps', '8'])" in out  # --save-result is the dispatcher's, not the benchmark's
    assert "================ folio bench fake ================" in out
    assert "host ms/step at B=256:                   4" in out
    assert "served/static (x):                       1.9" in out
    saved = json.loads(result.read_text())
    assert saved["figures"] == {"host ms/step at B=256": 4.0, "served/static (x)": 1.9}
    assert saved["exit_status"] == 0 and saved["argv"] == ["--steps", "8"] and "ran 8 steps" in saved["output"]
    assert sys.argv == argv_before
    # the benchmark's exit status and its argparse errors come through
    assert folio_main(["bench", "fake", "--steps", "2", "--fail"]) == 3
    assert "Exit status:                             3" in capsys.readouterr().out
    assert folio_main(["bench", "fake"]) == 2
    assert "--steps" in capsys.readouterr().err
    assert folio_main(["bench", "nosuch"]) == 2
    assert "unknown benchmark 'nosuch'; one of: serve, list, fake" in capsys.readouterr().err


def test_a_real_script_through_the_cli():
    proc = subprocess.run([sys.executable, "-m", "folio.cli.main", "bench", "step", "--help"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "usage: folio bench step" in proc.stdout and "--steps" in proc.stdout
    assert "Exit status:                             0" in proc.stdout


def test_in_process_cpu_benchmarks_spin_torchs_threads_as_the_executor_service_does(tmp_path):
    """``folio bench cpu_step`` / ``spec_decode`` (and their scripts) set ``GOMP_SPINCOUNT`` before
    torch loads, as ``folio run executor`` does for a model on the C kernels; others, or an fp32
    model, keep libgomp's default. A fresh interpreter each: torch must not be loaded yet."""
    import os

    model = tmp_path / "m.gguf"
    model.write_bytes(b"")  # only its name is read: a GGUF steps on the C kernels
    probe = ("import os, sys; from folio.cli.bench import spin_as_served; "
             "print(spin_as_served(sys.argv[1], sys.argv[2:]), os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}

    def run(*argv: str) -> str:
        return subprocess.run([sys.executable, "-c", probe, *argv], env=env, capture_output=True, text=True,
                              check=True).stdout.strip()

    assert run("cpu_step", "--model", str(model)) == "10000 10000 False"
    assert run("spec_decode", "--model", str(model), "--quantization", "none") == "None None False"
    assert run("serving", "--model", str(model)) == "None None False"
    assert run("cpu_step", "--model", str(tmp_path / "missing")) == "None None False"
