"""``folio bench spec_decode --served-only``: the served, open-loop section starts ``folio serve``
for plain decoding and for a proposer (payoff served), sends the same requests at the same arrival
times, and prints the ratio with the texts compared; and the cpu_step verify step's ratio."""

from __future__ import annotations

import re

import pytest

from folio.bench import cpu_step, spec_decode


def assert_ratio_of_rounded(ratio: float, a: float, b: float, half_step: float) -> None:
    """``ratio`` (printed to two places) is a/b of the unrounded figures, which were printed to
    within ``half_step``: at 0.3 s a second's rounding alone moves the quotient by 3%."""
    low, high = (a - half_step) / (b + half_step), (a + half_step) / (b - half_step)
    assert low - 0.005 <= ratio <= high + 0.005, (ratio, a, b)


@pytest.mark.slow
def test_the_served_section_compares_a_proposer_with_plain_on_the_same_open_loop(capsys):
    spec_decode.main(["--served-only", "--proposers", "ngram-adaptive", "--served-requests", "4",
                      "--served-rate", "20", "--max-tokens", "12", "--served-workload", "mixed"])
    out = capsys.readouterr().out
    assert "served, open loop: 4 mixed requests (20/s Poisson)" in out
    row = re.search(r"^ngram-adaptive" + r"\s+([\d.]+)" * 7 + r"(.*)$", out, re.M)
    assert row is not None, out
    plain, spec, ratio, plain_s, spec_s, latency_ratio = (float(row.group(i)) for i in range(1, 7))
    assert plain > 0 and spec > 0
    assert_ratio_of_rounded(ratio, spec, plain, 0.05)
    assert_ratio_of_rounded(latency_ratio, plain_s, spec_s, 0.005)
    assert float(row.group(7)) >= 1.0  # the scheduler's mean accepted length
    assert "OUTPUT DIFFERS" not in row.group(8)  # greedy: speculation changes no text


@pytest.mark.slow
def test_a_verify_step_scores_its_rows(capsys):
    assert cpu_step.main(["--batches", "1", "--verify", "3", "--steps", "4", "--repeats", "1", "--context", "32"]) == 0
    out = capsys.readouterr().out
    one = float(re.search(r"^passes \d batch 1 ms/step: ([\d.]+)$", out, re.M).group(1))
    three = float(re.search(r"^passes \d batch 1 verify 3 ms/step: ([\d.]+)$", out, re.M).group(1))
    ratio = float(re.search(r"verify 3 / batch 1 step: ([\d.]+) \(rounds: ([\d.]+)\)", out).group(1))
    assert one > 0 and three > 0 and abs(ratio - three / one) < 0.01
