"""scripts/eval_quant.py as the CI quality gate: the default model's int4 serving against the fp32
reference on text the model writes itself (a short text here; README's table uses 10,240 tokens)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))


@pytest.mark.slow
def test_int4_quality_on_a_short_text_and_a_missed_target_fails_the_run(smollm_dir, capsys):
    import eval_quant

    # int4 against its targets, and a comparison that cannot hold (a KLD below itself): exit 1;
    # kv-fp8 (fp32 weights over the fp8 KV pool) shares the reference, one more teacher-forced pass
    rc = eval_quant.main(["--model", smollm_dir, "--configs", "int4", "kv-fp8", "--num-tokens", "640",
                          "--below", "int4", "int4"])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| int4 | int4 |")).split("|")
    kld, top1 = float(row[3]), float(row[4].strip().rstrip("%")) / 100
    # KLD holds its target on this short text; top-1 agreement sits near its 99% target (98.6% on
    # 727 tokens), so CI asks for 98% here and README reports the full-length figure
    assert kld <= 1e-3 and top1 >= 0.98, out
    # the fp8 KV cache (rotated basis) holds its KLD target and misses top-1 >= 98% on this model
    # (README: 4.0e-3 and 97.4% on these 727 tokens; 6.5e-3 and 95.9% without the rotation)
    fp8 = next(line for line in out.splitlines() if line.startswith("| kv-fp8 | none (fp8 KV) |")).split("|")
    assert float(fp8[3]) <= 5e-3 and float(fp8[4].strip().rstrip("%")) / 100 >= 0.965, out
    assert "KLD int4 < int4:" in out and "MISSED" in out.splitlines()[-2]
    assert rc == 1
