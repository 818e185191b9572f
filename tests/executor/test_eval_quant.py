"""scripts/eval_quant.py as the CI quality gate: the default model's int4 serving against the fp32
reference on text the model writes itself (a short text here; README's table uses 10,240 tokens)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))


@pytest.mark.slow
def test_int4_meets_its_targets_and_a_missed_one_fails_the_run(smollm_dir, capsys):
    import eval_quant

    # int4 against its targets; "int4 below int4-g64" is a comparison that cannot hold (int4 here
    # is the lossless Q4_1 repack, g64 a fresh round to nearest), so the run must exit 1
    rc = eval_quant.main(["--model", smollm_dir, "--configs", "int4", "int4-g64", "--num-tokens", "640",
                          "--below", "int4-g64", "int4"])
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| int4")}
    assert rows["int4"].rstrip().endswith("| ok |"), out
    assert "KLD int4-g64 < int4:" in out and "MISSED" in out.splitlines()[-2]
    assert rc == 1
