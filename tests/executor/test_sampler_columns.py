"""A sampling parameter lives in three places: the struct (``shared/sampling.py``), the
column builder (``kernels/sampler_columns.py``) and the C kernel (its column list in
``csrc/folio.h``, read by ``csrc/sampler.c``). These tests fail when one of them misses a parameter
the others have: every struct field is a column or set apart in ``NOT_COLUMNS``, the builder maps
each column from its own field, and the kernel's column list (the header's, and what the loaded
library says) is ``COLUMNS``, each column read by sampler.c."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from folio.core.executor.kernels import cpu_kernels, sampler_columns
from folio.core.executor.kernels.sampler_columns import COLUMNS, NOT_COLUMNS, column_values
from folio.shared.sampling import SamplingParams

SAMPLER_C = Path(cpu_kernels.CSRC / "sampler.c")
FOLIO_H = Path(cpu_kernels.CSRC / "folio.h")
VOCAB = 100
# a value other than the default for each column's field
CHANGED = {"temperature": 0.5, "top_p": 0.5, "min_p": 0.25, "presence_penalty": 0.5, "frequency_penalty": -0.5,
           "repetition_penalty": 1.5, "top_k": 7}


def c_columns(header: str) -> tuple[str, ...]:
    """The names of ``FOLIO_SAMPLER_COLUMNS(X)``, in order, as folio.h lists them."""
    body = re.search(r"#define FOLIO_SAMPLER_COLUMNS\(X\)((?:[^\n]*\\\n)*[^\n]*)", header).group(1)
    return tuple(re.findall(r"X\((\w+)\)", body))


def problems(fields: tuple[str, ...], columns: tuple[str, ...], not_columns, header: str, source: str) -> list[str]:
    """What is out of step between the struct's fields, the Python columns and the C kernel (its
    header's list, and sampler.c's reads)."""
    out = [f"{f}: neither a column nor in NOT_COLUMNS" for f in fields if f not in columns and f not in not_columns]
    out += [f"{f}: both a column and in NOT_COLUMNS" for f in fields if f in columns and f in not_columns]
    out += [f"{c}: a column but no field of the struct" for c in columns if c not in fields]
    out += [f"{n}: in NOT_COLUMNS but no field of the struct" for n in not_columns if n not in fields]
    if c_columns(header) != tuple(columns):
        out.append(f"folio.h lists {c_columns(header)}, the Python side {tuple(columns)}")
    out += [f"{c}: sampler.c never reads param[COL_{c}]" for c in columns if f"param[COL_{c}]" not in source]
    return out


def test_the_struct_the_columns_and_the_kernel_agree():
    assert problems(SamplingParams.__struct_fields__, COLUMNS, NOT_COLUMNS, FOLIO_H.read_text(),
                    SAMPLER_C.read_text()) == []


def test_each_way_of_falling_out_of_step_is_caught():
    """The check above can fail: a field added to the struct alone, a column the kernel lacks or
    lists in another order, a column it lists but never reads."""
    fields, header, source = SamplingParams.__struct_fields__, FOLIO_H.read_text(), SAMPLER_C.read_text()
    assert problems(fields + ("typical_p",), COLUMNS, NOT_COLUMNS, header, source) == \
        ["typical_p: neither a column nor in NOT_COLUMNS"]
    added = problems(fields + ("typical_p",), COLUMNS + ("typical_p",), NOT_COLUMNS, header, source)
    assert any("folio.h lists" in p for p in added) and any("never reads param[COL_typical_p]" in p for p in added)
    swapped = header.replace("X(top_p)", "X(@@)").replace("X(min_p)", "X(top_p)").replace("X(@@)", "X(min_p)")
    assert any("folio.h lists" in p for p in problems(fields, COLUMNS, NOT_COLUMNS, swapped, source))
    unread = source.replace("param[COL_min_p]", "0.0f")
    assert problems(fields, COLUMNS, NOT_COLUMNS, header, unread) == ["min_p: sampler.c never reads param[COL_min_p]"]


def test_the_index_constants_follow_the_list():
    assert [COLUMNS[i] for i in (sampler_columns.TEMPERATURE, sampler_columns.TOP_P, sampler_columns.MIN_P,
                                 sampler_columns.PRESENCE, sampler_columns.FREQUENCY, sampler_columns.REPETITION,
                                 sampler_columns.TOP_K)] == \
        ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "top_k"]
    assert sampler_columns.NUM_PARAMS == len(COLUMNS)


def test_the_builder_maps_each_column_from_its_own_field():
    """Defaults give the neutral row; changing one field changes its column and no other."""
    neutral = column_values(SamplingParams(), VOCAB)
    assert neutral == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0, float(VOCAB)]
    assert set(CHANGED) == set(COLUMNS)
    for name, value in CHANGED.items():
        row = column_values(SamplingParams(**{name: value}), VOCAB)
        changed = [COLUMNS[i] for i, (a, b) in enumerate(zip(row, neutral)) if a != b]
        assert changed == [name] and row[COLUMNS.index(name)] == value, name


def test_off_values_and_greedy_rows_in_the_columns():
    assert column_values(SamplingParams(top_k=0), VOCAB)[sampler_columns.TOP_K] == VOCAB
    assert column_values(SamplingParams(top_k=10 * VOCAB), VOCAB)[sampler_columns.TOP_K] == VOCAB
    greedy = column_values(SamplingParams(temperature=0.0), VOCAB)
    assert greedy[sampler_columns.TEMPERATURE] == 1.0  # a greedy row never divides by its temperature
    row = column_values(SamplingParams(presence_penalty=-0.0), VOCAB)
    assert str(row[sampler_columns.PRESENCE]) == "0.0"  # +0.0: the kernel reads a neutral row by its bits


def test_the_loaded_kernel_reads_the_python_columns():
    lib = cpu_kernels.library()
    if lib is None:
        pytest.skip("no C compiler here")
    assert cpu_kernels.sampler_columns(lib) == COLUMNS
    cpu_kernels.check_sampler_columns(lib)  # what the library's loading checks: it raises on a mismatch


def test_a_parameter_table_of_another_width_is_refused():
    import numpy as np
    import torch

    if cpu_kernels.library() is None:
        pytest.skip("no C compiler here")
    narrow = np.ones((2, len(COLUMNS) - 1), dtype=np.float32)
    with pytest.raises(ValueError, match="sampling parameters"):
        cpu_kernels.sample(torch.zeros(2, VOCAB), np.zeros(2, dtype=bool), narrow, None, None,
                           np.zeros(2, dtype=np.int64), np.zeros(2, dtype=np.int64))
