"""The CPU kernels' interface is declared once and checked: ``csrc/folio.h`` is the one header every C
file includes; ``cpu_kernels.py``'s ctypes declarations (``FUNCTIONS``, ``STRUCTS``) match its
prototypes and structs field by field; every symbol the library exports is declared; and the
checked entry points refuse bad arguments with an exception instead of writing."""

from __future__ import annotations

import ctypes
import re
import subprocess

import numpy as np
import pytest
import torch

from folio.core.executor.kernels import cpu_kernels

HEADER = cpu_kernels.CSRC / "folio.h"
_SCALARS = {"int64_t": ctypes.c_int64, "float": ctypes.c_float, "double": ctypes.c_double}


def _code(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"^\s*#.*$", " ", text, flags=re.M)


def _ctype(decl: str):
    """A C parameter, field or return type -> the ctypes type folio declares for it."""
    decl = re.sub(r"\bconst\b", " ", decl).strip()
    stars = decl.count("*")
    base = decl.replace("*", " ").split()[0]
    if stars == 0:
        return None if base == "void" else _SCALARS[base]
    if stars == 1 and base in cpu_kernels.STRUCTS:
        return ctypes.POINTER(cpu_kernels.STRUCTS[base])
    if stars == 1 and base == "char":
        return ctypes.c_char_p
    return ctypes.c_void_p


def header_prototypes() -> dict[str, tuple]:
    out = {}
    for ret, name, args in re.findall(r"([\w\s\*]+?)\b(folio_\w+)\s*\(([^)]*)\)\s*;", _code(HEADER.read_text())):
        if name in cpu_kernels.INTERNAL:
            out[name] = None
            continue
        params = [] if args.strip() in ("", "void") else [re.sub(r"\w+\s*$", "", a.strip()) for a in args.split(",")]
        out[name] = (_ctype(ret), [_ctype(p) for p in params])
    return out


def header_structs() -> dict[str, list[tuple[str, object]]]:
    out = {}
    for body, name in re.findall(r"typedef struct \{(.*?)\}\s*(\w+);", _code(HEADER.read_text()), flags=re.S):
        fields = []
        for decl in filter(None, (d.strip() for d in body.split(";"))):
            kind, names = re.match(r"((?:const\s+)?\w+)\s+(.*)", decl).groups()
            for item in names.split(","):
                item = item.strip()
                stars, field = item.count("*"), item.replace("*", "").replace("const", "").strip()
                array = re.match(r"(\w+)\[(\w+)\]", field)
                base = kind.replace("const", "").strip()
                if array:
                    elem = cpu_kernels.STRUCTS[base] if base in cpu_kernels.STRUCTS else _SCALARS[base]
                    fields.append((array.group(1), elem * getattr(cpu_kernels, array.group(2).removeprefix("FOLIO_"))))
                elif stars:
                    fields.append((field, ctypes.c_void_p))
                else:
                    fields.append((field, cpu_kernels.STRUCTS.get(base) or _SCALARS[base]))
        out[name] = fields
    return out


def test_every_prototype_is_declared_once_as_the_header_says():
    protos = header_prototypes()
    declared = {n: f for n, f in cpu_kernels.FUNCTIONS.items()}
    assert set(protos) - set(cpu_kernels.INTERNAL) == set(declared)
    for name, (ret, args) in declared.items():
        want_ret, want_args = protos[name]
        assert (ret, [_key(a) for a in args]) == (want_ret, [_key(a) for a in want_args]), name


def _key(t):
    return (t._type_.__name__, "*") if hasattr(t, "_type_") and isinstance(t._type_, type) else t


def test_every_struct_matches_its_ctypes_structure_field_by_field():
    structs = header_structs()
    assert set(structs) == set(cpu_kernels.STRUCTS)
    for name, fields in structs.items():
        theirs = cpu_kernels.STRUCTS[name]._fields_
        assert [f[0] for f in fields] == [f[0] for f in theirs], name
        for (field, want), (_, got) in zip(fields, theirs):
            assert ctypes.sizeof(want) == ctypes.sizeof(got) and want._type_ == got._type_ \
                if hasattr(want, "_type_") and hasattr(got, "_type_") else want == got, (name, field)


def test_every_c_file_includes_the_header_and_declares_nothing_of_its_own():
    for source in cpu_kernels.SOURCES:
        text = source.read_text()
        assert '#include "folio.h"' in text, source.name
        # prototypes of another file's functions belong in the header
        declared = r"^(?:void|int|int64_t|float|double|const\s+char\s*\*)\s*(folio_\w+)\s*\([^;{]*\)\s*;"
        for proto in re.findall(declared, _code(text), flags=re.M):
            pytest.fail(f"{source.name} declares {proto} itself")


def test_every_exported_symbol_is_declared():
    lib = cpu_kernels.library()
    if lib is None:
        pytest.skip("no C compiler for the CPU kernels")
    out = subprocess.run(["nm", "-D", "--defined-only", lib._name], capture_output=True, text=True, check=True).stdout
    exported = {line.split()[-1] for line in out.splitlines() if line.split()[-1].startswith("folio_")}
    assert exported == set(cpu_kernels.FUNCTIONS) | set(cpu_kernels.INTERNAL)


def test_checked_entry_points_raise_and_write_nothing():
    lib = cpu_kernels.library()
    if lib is None:
        pytest.skip("no C compiler for the CPU kernels")
    k_cache, v_cache = torch.zeros(4, 8, 2, 16), torch.zeros(4, 8, 2, 16)
    kv = cpu_kernels.KV(k=k_cache.data_ptr(), v=v_cache.data_ptr(), num_blocks=4, block_size=8, num_kv_heads=2,
                        head_dim=16)
    qkv, q = torch.randn(2, 8 * 16), torch.zeros(2, 4, 16)
    cos, sin = torch.ones(32, 16), torch.zeros(32, 16)
    for positions, slots, error in (([0, 32], [0, 1], IndexError),   # a position past the RoPE tables
                                    ([0, 1], [0, 32], IndexError),   # a slot past the pool's 32
                                    ([-1, 1], [0, 1], IndexError)):
        pos, sl = np.array(positions, dtype=np.int64), np.array(slots, dtype=np.int64)
        with pytest.raises(error):
            cpu_kernels.check(lib, lib.folio_rope_write_kv(2, qkv.data_ptr(), qkv.stride(0), 0, pos.ctypes.data,
                                                           cos.data_ptr(), sin.data_ptr(), 32, sl.ctypes.data, 4,
                                                           ctypes.byref(kv), q.data_ptr()))
    assert not k_cache.any() and not v_cache.any() and not q.any()
    with pytest.raises(ValueError, match="stride"):  # a qkv row narrower than the heads it holds
        cpu_kernels.check(lib, lib.folio_rope_write_kv(2, qkv.data_ptr(), 16, 0, pos.ctypes.data, cos.data_ptr(),
                                                       sin.data_ptr(), 32, sl.ctypes.data, 4, ctypes.byref(kv),
                                                       q.data_ptr()))
    tables = torch.tensor([[0, 1], [2, 9]], dtype=torch.int32)  # block 9 is not in the pool
    tok, seq, lens = (np.array(v, dtype=np.int64) for v in ([0, 1], [0, 1], [5, 12]))
    rows = cpu_kernels.Rows(m=2, tok=tok.ctypes.data, seq=seq.ctypes.data, lens=lens.ctypes.data,
                            block_tables=tables.data_ptr(), num_seqs=2, max_blocks=2)
    out, scratch = torch.zeros(2, 4, 16), np.zeros(64, dtype=np.float32)
    with pytest.raises(IndexError, match="block 9"):
        cpu_kernels.check(lib, lib.folio_decode_attention(ctypes.byref(rows), q.data_ptr(), 2, 4, ctypes.byref(kv),
                                                          0.25, 0, 0.0, out.data_ptr(), scratch.ctypes.data, 32, 1))
    assert not out.any()
