"""``folio bench NAME``: runs ``scripts/bench_NAME.py`` as that script runs alone, with its own
flags, and prints one summary block in the shared format (JSON with ``--save-result``)."""

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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helper_mod import FACTOR  # noqa: E402  (the scripts import their neighbours)

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, required=True)
p.add_argument("--fail", action="store_true")


def main():
    args = p.parse_args()
    print(f"ran {args.steps} steps (argv {sys.argv[1:]})")
    print(f"host ms/step at B=256: {args.steps * FACTOR}")
    print("served/static = 1.9x")
    if args.fail:
        raise SystemExit(3)


if __name__ == "__main__":
    main()
'''


def test_every_script_is_a_subcommand(capsys):
    assert folio_main(["bench", "list"]) == 0
    out = capsys.readouterr().out
    names = sorted(p.stem[len("bench_"):] for p in (ROOT / "scripts").glob("bench_*.py"))
    assert len(names) >= 12
    listed = [line.split()[0] for line in out.splitlines() if line.strip()]
    assert listed == ["serve", *names]


def test_a_script_runs_with_its_flags_and_the_shared_summary(tmp_path, monkeypatch, capsys):
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "bench_fake.py").write_text(FAKE)
    (scripts / "helper_mod.py").write_text("FACTOR = 0.5\n")
    monkeypatch.setattr(bench, "SCRIPTS_DIR", scripts)
    argv_before = list(sys.argv)
    result = tmp_path / "r.json"
    assert folio_main(["bench", "fake", "--steps", "8", "--save-result", str(result)]) == 0
    out = capsys.readouterr().out
    assert "ran 8 steps (argv ['--steps', '8'])" in out  # --save-result is the dispatcher's, not the script's
    assert "================ folio bench fake ================" in out
    assert "host ms/step at B=256:                   4" in out
    assert "served/static (x):                       1.9" in out
    saved = json.loads(result.read_text())
    assert saved["figures"] == {"host ms/step at B=256": 4.0, "served/static (x)": 1.9}
    assert saved["exit_status"] == 0 and saved["argv"] == ["--steps", "8"] and "ran 8 steps" in saved["output"]
    assert sys.argv == argv_before
    # the script's exit status and its argparse errors come through
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
    assert "usage: bench_step.py" in proc.stdout and "--steps" in proc.stdout
    assert "Exit status:                             0" in proc.stdout
