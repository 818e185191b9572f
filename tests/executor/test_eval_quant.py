"""The quality gate (``folio bench eval_quant``) in CI, run for real on SmolLM2: the shipped
configurations against the fp32 reference on text the model writes itself (4,183 tokens here,
--num-tokens 4096; the full gate uses 10,240), each held to its target in eval_quant.TARGETS; and a
configuration made worse on purpose, which the gate must fail."""

from __future__ import annotations

import pytest

NUM_TOKENS = "4096"
SHIPPED = ["int4", "int8", "int8-gptq", "kv-fp8"]
# The issue's 98% top-1 target is missed by these on SmolLM2's 4,183-token text (97.11%, 97.90%,
# 97.25% measured; docs/quantization.md): the gate reports them MISSED and exits 1. Reaching the
# target is welcome; a miss of anything else, or of any KLD target, fails this test.
KNOWN_TOP1_MISSES = {"int8", "int8-gptq", "kv-fp8"}


def table_rows(out: str) -> dict[str, list[str]]:
    """The gate's result table: config label -> its cells."""
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) == 7 and cells[0] not in ("config", "---"):
            rows[cells[0]] = cells
    return rows


@pytest.mark.slow
def test_the_shipped_configurations_against_their_targets(smollm_dir, tmp_path, capsys):
    from folio.bench import eval_quant
    from folio.cli.quantize import main as quantize

    # folio quantize --method int8 (GPTQ over the model's own sampled text, 2,048 tokens)
    assert quantize(["--method", "int8", smollm_dir, str(tmp_path / "int8")]) == 0
    capsys.readouterr()
    # int4 (the default), load-time int8, the GPTQ folder and kv-fp8 (fp32 weights over the fp8 KV
    # pool) share the reference text, one teacher-forced pass each; GPTQ must also beat round to nearest
    rc = eval_quant.main(["--model", smollm_dir, "--configs", "int4", "int8", f"int8-gptq={tmp_path / 'int8'}",
                          "kv-fp8", "--num-tokens", NUM_TOKENS, "--below", "int8-gptq", "int8"])
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert sorted(rows) == sorted(SHIPPED), out
    assert rows["int4"][6] == "ok", out
    for name in SHIPPED:
        max_kld, min_top1 = eval_quant.TARGETS[name]
        assert float(rows[name][2]) <= max_kld, out  # every KLD target is met
        if rows[name][6] == "MISSED":  # on top-1 alone, and only where that miss is known
            assert name in KNOWN_TOP1_MISSES and float(rows[name][3].rstrip("%")) < 100 * min_top1, out
    below = next(line for line in out.splitlines() if line.startswith("KLD int8-gptq < int8:"))
    assert below.endswith(" ok"), out
    missed = [name for name in SHIPPED if rows[name][6] == "MISSED"]
    assert rc == (1 if missed else 0), out


@pytest.mark.slow
def test_a_worse_configuration_misses_its_target_and_fails_the_gate(smollm_dir, tmp_path, capsys):
    from folio.bench import eval_quant
    from folio.cli.quantize import main as quantize

    # int4 rounded to nearest in groups of 64 (twice the shipped group size, no fractional zero
    # points): held to int4's targets it misses both by far (3.1e-1 KLD, 74.8% top-1 measured)
    assert quantize(["--method", "int4", "--group-size", "64", smollm_dir, str(tmp_path / "g64")]) == 0
    capsys.readouterr()
    rc = eval_quant.main(["--model", smollm_dir, "--configs", f"int4-rtn-g64={tmp_path / 'g64'}",
                          "--num-tokens", NUM_TOKENS])
    out = capsys.readouterr().out
    row = table_rows(out)["int4-rtn-g64"]
    assert row[5] == "KLD <= 0.001, top-1 >= 99.0%" and row[6] == "MISSED", out
    assert float(row[2]) > 1e-3 and float(row[3].rstrip("%")) < 99.0, out
    assert rc == 1
