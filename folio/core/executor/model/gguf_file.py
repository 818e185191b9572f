"""A GGUF file's metadata and tensors, read fast: the header parsed with ``struct``, arrays of strings
(the tokenizer's vocabulary) skipped unless asked for, and every tensor a view of one memory map.

gguf-py's ``GGUFReader`` builds a numpy array per string of the vocabulary: 20 s for SmolLM2's
49k tokens on a loaded 2-core machine, more for Llama 3's 128k. folio reads only the config's
numbers and the tensors, so this reads the same format (version 2 and 3) without them. A tensor
here has the fields of gguf-py's ``ReaderTensor`` that folio reads (``name``, ``tensor_type``,
``shape``, ``n_elements``, ``n_bytes``, ``data_offset``, ``data``), with ``data`` shaped as
gguf-py shapes it (quantized: ``[rows, bytes a row]``).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32, 7: np.bool_,
          10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY = 8, 9
_ITEM = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32,
         "I64": np.int64}


@dataclass
class GGUFTensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: np.ndarray  # GGUF's dims, innermost first
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class GGUFFile:
    """``fields``: key -> value (str, int, float, bool, list); string arrays are None unless their
    key starts with one of ``read_strings``. ``tensors``: in the file's order."""

    def __init__(self, path: str | Path, read_strings: tuple[str, ...] = ()):
        import gguf

        self.path = Path(path)
        with open(self.path, "rb") as f:
            self.mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self.mmap
        if buf[:4] != MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file")
        version, num_tensors, num_fields = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} (2 and 3 are read)")
        self._at = 24
        self.fields: dict[str, object] = {}
        for _ in range(num_fields):
            key = self._string()
            (vtype,) = struct.unpack_from("<I", buf, self._at)
            self._at += 4
            self.fields[key] = self._value(vtype, key.startswith(read_strings) if read_strings else False)
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            (n_dims,) = struct.unpack_from("<I", buf, self._at)
            dims = np.frombuffer(buf, dtype=np.uint64, count=n_dims, offset=self._at + 4).astype(np.int64)
            ggml_type, offset = struct.unpack_from("<IQ", buf, self._at + 4 + 8 * n_dims)
            self._at += 4 + 8 * n_dims + 12
            infos.append((name, dims, ggml_type, offset))
        align = int(self.fields.get("general.alignment", 32))
        start = (self._at + align - 1) // align * align
        self.data = np.frombuffer(buf, dtype=np.uint8)
        self.tensors = [self._tensor(gguf, start, *info) for info in infos]

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self.mmap, self._at)
        s = self.mmap[self._at + 8:self._at + 8 + n].decode("utf-8", errors="replace")
        self._at += 8 + n
        return s

    def _value(self, vtype: int, keep_strings: bool):
        buf = self.mmap
        if vtype == STRING:
            return self._string()
        if vtype in _SCALARS:
            fmt = _SCALARS[vtype]
            (v,) = struct.unpack_from(fmt, buf, self._at)
            self._at += struct.calcsize(fmt)
            return v
        if vtype != ARRAY:
            raise ValueError(f"{self.path}: unknown GGUF value type {vtype}")
        item, n = struct.unpack_from("<IQ", buf, self._at)
        self._at += 12
        if item in _NUMPY:
            values = np.frombuffer(buf, dtype=_NUMPY[item], count=n, offset=self._at)
            self._at += values.nbytes
            return values.tolist()
        if item == STRING:
            if keep_strings:
                return [self._string() for _ in range(n)]
            for _ in range(n):  # skipped: only their lengths are read
                (length,) = struct.unpack_from("<Q", buf, self._at)
                self._at += 8 + length
            return None
        return [self._value(item, keep_strings) for _ in range(n)]  # arrays of arrays

    def _tensor(self, gguf, start: int, name: str, dims: np.ndarray, ggml_type: int, offset: int) -> GGUFTensor:
        qtype = gguf.GGMLQuantizationType(ggml_type)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n_elements = int(np.prod(dims))
        n_bytes = n_elements * type_size // block
        np_dims = tuple(reversed(dims.tolist()))
        at = start + offset
        if qtype.name in _ITEM:
            item = np.dtype(_ITEM[qtype.name])
            data = self.data[at:at + n_bytes].view(item).reshape(np_dims)
        else:
            data = self.data[at:at + n_bytes].reshape(gguf.quant_shape_to_byte_shape(np_dims, qtype))
        return GGUFTensor(name, qtype, dims, n_elements, n_bytes, at, data)

    def release(self, tensor: GGUFTensor) -> None:
        """Let the kernel drop the tensor's pages from this process (they stay in the page cache):
        a tensor repacked once is not read again, and its mapped pages would count as resident."""
        page = mmap.PAGESIZE
        lo = tensor.data_offset // page * page
        hi = -(-(tensor.data_offset + tensor.n_bytes) // page) * page
        try:
            self.mmap.madvise(mmap.MADV_DONTNEED, lo, min(hi, len(self.mmap)) - lo)
        except (AttributeError, OSError, ValueError):
            pass  # an old Python or another OS: the pages stay mapped until the file is closed
