"""scripts/eval_quant.py as the CI quality gate: the default model's int4 serving (and int8, kv-fp8)
against the fp32 reference on text the model writes itself (a short text here; README's table uses 10,240 tokens)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))


@pytest.mark.slow
def test_int4_quality_on_a_short_text_and_a_missed_target_fails_the_run(smollm_dir, tmp_path, capsys):
    import eval_quant

    from folio.cli.quantize import main as quantize

    # folio quantize --method int8 (GPTQ over the model's own sampled text, 2,048 tokens)
    assert quantize(["--method", "int8", smollm_dir, str(tmp_path / "int8")]) == 0
    capsys.readouterr()
    # int4 against its targets, and a comparison that cannot hold (a KLD below itself): exit 1;
    # kv-fp8 (fp32 weights over the fp8 KV pool), load-time int8 and the GPTQ folder share the
    # reference, one more teacher-forced pass each
    rc = eval_quant.main(["--model", smollm_dir, "--configs", "int4", "kv-fp8", "int8",
                          f"int8-gptq={tmp_path / 'int8'}", "--num-tokens", "640",
                          "--below", "int8-gptq", "int8", "--below", "int4", "int4"])
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
    # GPTQ's int8 holds its KLD target and beats round to nearest (README: 1.5e-3 and 98.5% on the
    # full 10,327-token text against 2.8e-3 and 97.7%; 2.5e-3 and 96.7% on these 727 tokens)
    gptq = next(line for line in out.splitlines() if line.startswith("| int8-gptq | int8 |")).split("|")
    assert float(gptq[3]) <= 5e-3 and float(gptq[4].strip().rstrip("%")) / 100 >= 0.96, out
    below = next(line for line in out.splitlines() if line.startswith("KLD int8-gptq < int8:"))
    assert below.endswith(" ok"), out
    assert "KLD int4 < int4:" in out and "MISSED" in out.splitlines()[-2]
    assert rc == 1
