"""scripts/gpu_check.sh without a GPU: its time limits add up to under 5 minutes and every command it
runs is held to them; bad arguments are refused; its test stages' report (tests/cuda/check_report.py)
holds each test's outcome and fails a session in which nothing passed; ``--dry-run`` runs every
stage's CPU stand-in and writes each stage's log, figures and result and the summary; a stage cut
short by its limit keeps its log and result, and the stages after it still run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
# set-up, then in order of value
STAGES = ["prepare", "compile", "served", "gpu_tests", "gpu_models", "kernels", "step", "quant"]


def run(*args: str, out: Path | None = None, env: dict | None = None,
        timeout: int = 60) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    if out is not None:
        full_env["OUT"] = str(out)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=full_env,
                          timeout=timeout, cwd="/")


def test_the_limits_add_up_to_under_five_minutes():
    result = run("--budget")
    assert result.returncode == 0, result.stderr
    *stages, total = [line.split() for line in result.stdout.splitlines()]
    assert [name for name, _ in stages] == STAGES
    assert total[0] == "total" and int(total[1]) == sum(int(s) for _, s in stages)
    assert int(total[1]) < 300


def test_every_command_runs_under_its_stage_limit():
    """``timeout`` is called once, in ``within``; every Python and nvidia-smi the stages run goes
    through it."""
    code = "\n".join(line for line in SCRIPT.read_text().splitlines() if not line.lstrip().startswith("#"))
    assert [line.strip() for line in code.splitlines() if re.search(r"\btimeout\s+-", line)] == \
        ['timeout -k 2 "$left" "$@"']
    commands = list(re.finditer(r'"\$PY" -|\bnvidia-smi\b', code))
    assert len(commands) >= 10
    for command in commands:
        line = code[code.rfind("\n", 0, command.start()) + 1:code.find("\n", command.end())]
        assert code[:command.start()].endswith("within "), f"not under a stage's limit: {line}"


@pytest.mark.parametrize("args,message", [
    (["--limit", "served=290"], "must stay under 300 s"),
    (["--limit", "served"], "--limit needs STAGE=SECONDS"),
    (["--limit", "nope=3"], "no stage 'nope'"),
    (["--only", "served,nope"], "no stage 'nope'"),
    (["--frobnicate"], "unknown argument '--frobnicate'"),
])
def test_bad_arguments_are_refused(tmp_path, args, message):
    result = run(*args, out=tmp_path / "out")
    assert result.returncode == 2
    assert message in result.stderr
    assert not (tmp_path / "out").exists()  # refused before anything ran


def test_only_and_limit_select_and_resize_stages():
    result = run("--only", "quant,served", "--limit", "quant=20", "--budget")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n") == ["served 55", "quant 20", "total 75", ""]


CASES = """
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("no device")

def test_passes(record_property):
    record_property("tok_s", 12.5)

def test_fails():
    assert 1 == 2, "tokens differ"

def test_skips():
    pytest.skip("needs a GPU")

def test_errors(broken):
    pass
"""


def run_with_report(folder: Path, source: str, *args: str) -> tuple[int, dict]:
    (folder / "test_cases.py").write_text(source)
    report = folder / "report.json"
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                             "tests.cuda.check_report", "--check-json", str(report), "--rootdir", str(folder),
                             *args, str(folder / "test_cases.py")], capture_output=True, text=True, timeout=120,
                            cwd=ROOT, env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    return result.returncode, json.loads(report.read_text())


def test_the_report_holds_each_tests_outcome(tmp_path):
    rc, report = run_with_report(tmp_path, CASES)
    assert rc == 1
    assert {k: report[k] for k in ("passed", "failed", "error", "skipped", "running")} == \
        {"passed": 1, "failed": 1, "error": 1, "skipped": 1, "running": 0}
    tests = {name.split("::")[1]: t for name, t in report["tests"].items()}
    assert tests["test_passes"]["properties"] == {"tok_s": 12.5}
    assert "tokens differ" in tests["test_fails"]["message"]
    assert tests["test_skips"]["message"] == "Skipped: needs a GPU"
    assert "no device" in tests["test_errors"]["message"]


def test_a_session_in_which_no_test_passed_fails(tmp_path):
    rc, report = run_with_report(tmp_path, CASES, "-k", "skips")
    assert rc == 1 and report["skipped"] == 1 and report["passed"] == 0
    rc, report = run_with_report(tmp_path, CASES, "-k", "passes")
    assert rc == 0 and report["passed"] == 1


def probe_wheel(folder: Path) -> Path:
    """A pure-Python wheel, to carry as --fetch-wheels' would be."""
    folder.mkdir()
    path = folder / "gpu_check_probe-1.0-py3-none-any.whl"
    info = "gpu_check_probe-1.0.dist-info"
    files = {"gpu_check_probe.py": "VALUE = 1\n",
             f"{info}/METADATA": "Metadata-Version: 2.1\nName: gpu-check-probe\nVersion: 1.0\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: folio-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr(f"{info}/RECORD", "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"]))
    return folder


def read(out: Path, name: str) -> dict:
    return json.loads((out / name).read_text())


@pytest.mark.slow  # every stage's CPU stand-in: served stack, emulated kernels, benchmarks (1-3 min)
def test_dry_run_writes_every_stage_and_the_summary(tmp_path):
    out = tmp_path / "out"
    result = run("--dry-run", out=out, env={"FOLIO_WHEEL_DIR": str(probe_wheel(tmp_path / "wheels"))},
                 timeout=1200)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    summary = read(out, "summary.json")
    assert summary["mode"] == "dry-run" and summary["status"] == "pass" and summary["budget_s"] < 300
    assert [s["name"] for s in summary["stages"]] == STAGES
    for stage in STAGES:
        assert read(out, f"{stage}.result.json") in summary["stages"]
        assert read(out, f"{stage}.result.json")["status"] == "pass"
        assert (out / f"{stage}.log").stat().st_size > 0
    assert all(line.split()[1] == "pass" for line in (out / "summary.txt").read_text().splitlines()[1:])

    assert read(out, "prepare.json")["missing"] == []
    assert read(out, "compile.json")["compiled"] == 2
    assert (out / "site" / "gpu_check_probe.py").exists()  # the carried wheel, installed for a cp312 image
    served = read(out, "served.json")
    assert (served["passed"], served["failed"], served["skipped"]) == (2, 0, 0)
    assert any("served_tokens_per_s" in t.get("properties", {}) for t in served["tests"].values())
    for stage in ("gpu_tests", "gpu_models"):
        report = read(out, f"{stage}.json")
        assert report["passed"] >= 3 and report["failed"] == report["error"] == 0
    kernels = read(out, "kernels.json")
    assert len(kernels["decode"]) == 1 and len(kernels["prefill"]) == 2
    assert all(row["paged_us"] > 0 for row in kernels["decode"] + kernels["prefill"])
    step = read(out, "step.json")
    assert [(r["mode"], r["batch"]) for r in step["rows"]] == [("graphs", 1), ("graphs", 2), ("eager", 1), ("eager", 2)]
    assert [(r["mode"], r["batch"]) for r in read(out, "quant.json")["rows"]] == [("awq", 1)]


@pytest.mark.slow  # a served stage cut after 2 s, then the emulated quant stage: 10-30 s
def test_a_stage_cut_short_keeps_its_log_and_the_next_stage_runs(tmp_path):
    out = tmp_path / "out"
    result = run("--dry-run", "--only", "served,quant", "--limit", "served=1", out=out, timeout=600)
    assert result.returncode == 1
    served, quant = read(out, "served.result.json"), read(out, "quant.result.json")
    assert served["status"] == "timeout" and served["seconds"] <= served["limit_s"] + 1
    assert "served: stopped at its limit" in (out / "served.log").read_text()
    assert quant["status"] == "pass"
    summary = read(out, "summary.json")
    assert summary["status"] == "fail" and summary["stages"] == [served, quant]
    assert not (out / "prepare.result.json").exists()
