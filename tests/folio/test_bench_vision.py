"""``folio bench vision``: the same image and question asked twice is a prefix hit through the
image (the warm prompt finds every block but its last cached and runs no tower), and the bench
prints the ratio of the two times to first token."""

from __future__ import annotations

import re

import pytest

from folio.bench import vision


@pytest.mark.slow
def test_the_warm_ask_hits_the_cache_through_the_image(capsys, tmp_path):
    assert vision.main(["--rounds", "1", "--text-layers", "1", "--keep", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    row = re.search(r"^round 0: cold ([\d.]+) s \((\d+) tokens cached\), warm ([\d.]+) s \((\d+) tokens cached, "
                    r"(\d+) images through the tower\)$", out, re.M)
    assert row is not None, out
    cold_hit, warm_hit, towers = int(row.group(2)), int(row.group(4)), int(row.group(5))
    # a new image is cold; the same again holds 196 placeholders and the text around them in full blocks
    assert cold_hit == 0 and warm_hit >= 196 and warm_hit % 16 == 0 and towers == 0
    ratio = float(re.search(r"^warm / cold: ([\d.]+)$", out, re.M).group(1))
    assert 0 < ratio and abs(ratio - float(row.group(3)) / float(row.group(1))) < 0.01
