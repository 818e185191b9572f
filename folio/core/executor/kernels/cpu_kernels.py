"""The CPU's C kernels (``csrc/``): compiled once per machine, loaded with ctypes.

``csrc/folio.h`` is the library's one interface; this module declares its structs and entry points
once (``STRUCTS``, ``FUNCTIONS``, checked against the header by the tests), raises for their error
codes (``check``), and wraps the sampler (``sample``, ``TableSampler``). The sources are compiled
with the machine's C compiler (``$CC``, else ``cc``/``gcc``) into the folio cache under a name that
hashes the sources, the compiler, the flags and the CPU's features; without a compiler
``library()`` is None and the torch ops run. ``library_for(march)`` builds them for another target
(the tests check an AVX2-only build on CPUs with AVX-512); ``FOLIO_SANITIZE=address,undefined``
builds them with those sanitizers (``tests/executor/test_sanitizers.py``). docs/executor.md has the design.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np
import structlog
import torch

from folio.core.executor.kernels.sampler_columns import COLUMNS, NUM_PARAMS
from folio.core.executor import startup
from folio.core.executor.kernels.toolchain import c_compiler, c_sanitizers
from folio.shared.config import cache_dir

log = structlog.get_logger()

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(CSRC / f for f in ("pool.c", "quant.c", "layers.c", "stack.c", "sampler.c"))
HEADERS = (CSRC / "folio.h", CSRC / "common.h")
# 512-bit vectors where the CPU has them (gcc's -march=native picks 256-bit ones on some that do)
# -fno-trapping-math: no value changes, but without it gcc leaves the selects in the exp and
# penalty loops scalar on AVX2-only CPUs (a 2x slower sampler on one)
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp-simd", "-ffp-contract=off",
         "-fno-math-errno", "-fno-trapping-math", "-std=c11", "-pthread", "-shared", "-fPIC")
BLOCK = 64  # csrc/sampler.c's BLOCK
# FOLIO_SANITIZE: the same build with the sanitizers' checks and stack traces (another cache key)
SANITIZER_FLAGS = ("-g", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all")

# ---------------------------------------------------------------------------- the interface (csrc/folio.h)
_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
OK, EINVAL, ENOMEM, ERANGE = 0, -1, -2, -3
MAX_PARTS = 4


class Part(ctypes.Structure):
    _fields_ = [("type", _i64), ("n", _i64), ("nbytes", _i64), ("data", _ptr)]


class Weight(ctypes.Structure):
    _fields_ = [("n", _i64), ("k", _i64), ("num_parts", _i64), ("parts", Part * MAX_PARTS)]


class Matrix(ctypes.Structure):
    _fields_ = [("data", _ptr), ("rows", _i64), ("cols", _i64), ("stride", _i64), ("dtype", _i64)]


class KV(ctypes.Structure):
    _fields_ = [("k", _ptr), ("v", _ptr), ("num_blocks", _i64), ("block_size", _i64), ("num_kv_heads", _i64),
                ("head_dim", _i64)]


class Rows(ctypes.Structure):
    _fields_ = [("m", _i64), ("tok", _ptr), ("seq", _ptr), ("lens", _ptr), ("block_tables", _ptr),
                ("num_seqs", _i64), ("max_blocks", _i64), ("extra", _ptr), ("window_ends", _ptr)]


class Layer(ctypes.Structure):
    _fields_ = [("qkv", Weight), ("o", Weight), ("gate_up", Weight), ("down", Weight), ("post_norm", _ptr),
                ("next_norm", _ptr), ("kv", KV), ("window", _i64), ("gelu", _i64)]


class Stack(ctypes.Structure):
    _fields_ = [("num_layers", _i64), ("layers", _ptr), ("hidden", _i64), ("num_heads", _i64), ("head_dim", _i64),
                ("intermediate", _i64), ("eps", _f32), ("scale", _f32), ("softcap", _f32), ("first_norm", _ptr),
                ("cos_table", _ptr), ("sin_table", _ptr), ("rope_len", _i64), ("act_bf16", _i64), ("passes", _i64),
                ("threads", _i64), ("profile_ns", _ptr)]
STACK_PARTS = ("norms", "qkv", "rope", "attention", "o", "gate_up", "act", "down")  # folio.h's FOLIO_P_*


class Step(ctypes.Structure):
    _fields_ = [("n", _i64), ("residual", _ptr), ("positions", _ptr), ("slots", _ptr), ("rows", Rows),
                ("out", _ptr), ("work", _ptr), ("work_bytes", _i64), ("taps", _ptr)]


STRUCTS = {"folio_part": Part, "folio_weight": Weight, "folio_matrix": Matrix, "folio_kv": KV, "folio_rows": Rows,
           "folio_layer": Layer, "folio_stack": Stack, "folio_step": Step}
_W, _M, _KV, _R, _S, _T = (ctypes.POINTER(c) for c in (Weight, Matrix, KV, Rows, Stack, Step))
# every exported function: (return type, argument types), in folio.h's order; a test reads the header
# and checks each against its prototype
FUNCTIONS = {
    "folio_error_message": (ctypes.c_char_p, [_i64]),
    "folio_last_error": (ctypes.c_char_p, []),
    "folio_unit": (_i64, [_i64]),
    "folio_unit_bytes": (_i64, [_i64]),
    "folio_raw_unit_bytes": (_i64, [_i64]),
    "folio_tiles_bytes": (_i64, [_i64, _i64, _i64]),
    "folio_check_weight": (_i64, [_W]),
    "folio_repack": (_i64, [_i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64]),
    "folio_dequant_rows": (_i64, [_i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _ptr]),
    "folio_gemm": (_i64, [_W, _M, _M, _i64, _i64]),
    "folio_set_threads": (None, [_i64]),
    "folio_threads": (_i64, []),
    "folio_gemm_path": (ctypes.c_char_p, []),
    "folio_add_rms_norm": (_i64, [_i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _ptr, _f32, _ptr, _i64, _i64]),
    "folio_rope_write_kv": (_i64, [_i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _KV, _ptr]),
    "folio_silu_and_mul": (_i64, [_i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64]),
    "folio_gelu_tanh_and_mul": (_i64, [_i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64]),
    "folio_attention_scratch": (_i64, [_i64, _i64]),
    "folio_decode_attention": (_i64, [_R, _ptr, _i64, _i64, _KV, _f32, _i64, _f32, _ptr, _ptr, _i64, _i64]),
    "folio_check_kv": (_i64, [_KV]),
    "folio_check_tokens": (_i64, [_i64, _ptr, _i64, _ptr, _KV]),
    "folio_check_rows": (_i64, [_R, _i64, _KV, _i64, _ptr]),
    "folio_attend": (None, [_R, _ptr, _i64, _KV, _f32, _i64, _f32, _ptr, _ptr, _i64, _i64]),
    "folio_stack_work_bytes": (_i64, [_S, _i64, _i64]),
    "folio_decode_stack": (_i64, [_S, _T]),
    "folio_sampler_columns": (ctypes.c_char_p, []),
    "folio_sample": (_i64, [_i64, _i64, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _i64, _ptr,
                            _ptr, _ptr, _ptr]),
    "folio_record_penalties": (_i64, [_i64, _i64, _i64] + [_ptr] * 8),
    "folio_philox_uniforms": (_i64, [_i64, _ptr, _ptr, _i64, _i64, _ptr]),
    "folio_exp_nonpositive": (_i64, [_i64, _ptr, _ptr]),
}
# internal to the library, not called from Python
INTERNAL = ("folio_run_parallel", "folio_fail")


class KernelError(RuntimeError):
    """A kernel refused its arguments (``code``: folio.h's error code); nothing was written."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def check(lib, code: int) -> None:
    """Raise for a kernel's error code: IndexError for an index out of its table, MemoryError for a
    failed allocation, ValueError for the rest (each with the kernel's own message)."""
    if code == OK:
        return
    what = lib.folio_last_error().decode(errors="replace")
    if code == ERANGE:
        raise IndexError(what)
    if code == ENOMEM:
        raise MemoryError(what)
    raise ValueError(what or lib.folio_error_message(code).decode())


_lock = threading.Lock()
_library: ctypes.PyDLL | None = None
_tried = False
num_compiles = 0  # compiler runs in this process (a cached library counts none)


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def build_flags() -> tuple[str, ...]:
    """``FLAGS``, with the sanitizers ``$FOLIO_SANITIZE`` asks for."""
    sanitizers = c_sanitizers()
    return FLAGS + (f"-fsanitize={sanitizers}", *SANITIZER_FLAGS) if sanitizers else FLAGS


def _compile(flags: tuple[str, ...]) -> Path:
    compiler = c_compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    source = b"".join(f.read_bytes() for f in (*SOURCES, *HEADERS))
    # -march=native: the file is only good on CPUs with this one's features
    key = hashlib.sha256(source + " ".join((compiler, *flags, platform.machine(), _cpu_features())).encode())
    key = key.hexdigest()[:16]
    out = cache_dir() / "cpu-kernels" / f"folio-{key}.so"
    if out.exists():
        startup.note("kernels_cache", "hit")
        return out
    global num_compiles
    num_compiles += 1
    startup.note("kernels_cache", "miss")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        built = Path(tmp) / out.name
        proc = subprocess.run([compiler, *flags, f"-I{CSRC}", "-o", str(built), *map(str, SOURCES), "-lm"],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(built, out)  # atomic: a process compiling alongside finds a whole file or none
    return out


def library() -> ctypes.PyDLL | None:
    """The loaded kernels, or None when they cannot be built here (the torch ops then run)."""
    global _library, _tried
    if _tried:
        return _library
    with _lock:
        if not _tried:
            try:
                # PyDLL: the calls keep the GIL. They are short, and a released GIL must be won back
                # from whatever other thread took it meanwhile (the executor service's event loop)
                with startup.phase("kernels"):
                    _library = _load(_compile(build_flags()))
            except (OSError, RuntimeError) as exc:
                log.warning("the CPU kernels are unavailable; the torch ops run instead", error=str(exc))
            _tried = True
    return _library


def _load(path: Path) -> ctypes.PyDLL:
    lib = ctypes.PyDLL(str(path))
    for name, (restype, argtypes) in FUNCTIONS.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = restype
    check_sampler_columns(lib)  # a mismatch: library() is None, the torch ops run, the warning says why
    return lib


def library_for(march: str) -> ctypes.PyDLL:
    """The kernels compiled for another ``-march`` than this machine's (``x86-64-v3``: AVX2 and
    FMA, no AVX-512), for the tests: every kernel must stay correct where ``native`` means less
    than it does here. Raises RuntimeError when it cannot be built."""
    flags = tuple(f"-march={march}" if f == "-march=native" else f for f in build_flags())
    return _load(_compile(flags))


def _addr(t: torch.Tensor | np.ndarray | None) -> int | None:
    if t is None:
        return None
    return t.data_ptr() if isinstance(t, torch.Tensor) else t.ctypes.data


def _row_major(t: torch.Tensor, like: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.shape == like.shape and t.stride() == like.stride()


def usable(logits: torch.Tensor, bias: torch.Tensor | None = None, rep: torch.Tensor | None = None) -> bool:
    """Whether the kernel can read these: fp32 CPU rows, contiguous within each row, penalty
    tensors laid out as the logits."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
        return False
    if any(t is not None and not _row_major(t, logits) for t in (bias, rep)):
        return False
    return library() is not None


_scratch = threading.local()  # per thread: the kernel's working row


def _scratch_for(vocab: int) -> np.ndarray:
    buf = getattr(_scratch, "buf", None)
    if buf is None or len(buf) < _scratch_size(vocab):
        buf = _scratch.buf = np.empty(_scratch_size(vocab), dtype=np.float32)
    return buf


def _scratch_size(vocab: int) -> int:
    return 2 * vocab + vocab // BLOCK + 1  # the working row, its block maxima, top-k's copy


def sampler_columns(lib: ctypes.PyDLL) -> tuple[str, ...]:
    """The parameter columns the library's ``folio_sample`` reads, in index order."""
    return tuple(name for name in lib.folio_sampler_columns().decode().split(",") if name)


def check_sampler_columns(lib: ctypes.PyDLL) -> None:
    """Raise unless ``csrc/sampler.c`` reads the columns of ``sampler_columns.COLUMNS``, in order."""
    if sampler_columns(lib) != COLUMNS:
        raise RuntimeError(f"csrc/sampler.c reads the columns {sampler_columns(lib)}, but sampler_columns.COLUMNS "
                           f"is {COLUMNS}: the two lists must be the same")


def _keys(seeds: np.ndarray, positions: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
    seeds = np.ascontiguousarray(seeds, dtype=np.int64)  # the 64-bit keys' bits
    positions = np.ascontiguousarray(positions, dtype=np.int64)
    if seeds.shape != (m,) or positions.shape != (m,):
        raise ValueError(f"{m} rows need {m} seeds and positions, got {seeds.shape} and {positions.shape}")
    return seeds, positions


def _check_logits(logits: torch.Tensor, m: int, vocab: int) -> None:
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"the sampler reads fp32 CPU logits contiguous within each row, not {logits.dtype} "
                         f"{tuple(logits.shape)} on {logits.device} with strides {logits.stride()}")
    if logits.shape[0] != m or logits.shape[1] != vocab:
        raise ValueError(f"logits of shape {tuple(logits.shape)} for {m} rows of vocabulary {vocab}")


def _check_params(params: np.ndarray, rows: int) -> None:
    """``params``: C-contiguous fp32 with the columns the kernel reads (``sampler_columns.COLUMNS``),
    ``rows`` rows at least."""
    if params.dtype != np.float32 or params.ndim != 2 or not params.flags.c_contiguous \
            or params.shape[1] < NUM_PARAMS or params.shape[0] < rows:
        raise ValueError(f"sampling parameters of {params.dtype} {params.shape} for {rows} rows")


def _check_rows(index: np.ndarray, size: int, what: str = "row") -> None:
    """Every value of ``index`` in ``[0, size)`` (vectorised): the tables' rows, or the vocabulary."""
    if len(index) and (int(index.min()) < 0 or int(index.max()) >= size):
        bad = index[(index < 0) | (index >= size)]
        raise ValueError(f"{what} {int(bad[0])} is outside 0..{size - 1}")


def _penalty_ld(bias: torch.Tensor | None, rep: torch.Tensor | None, like: torch.Tensor) -> int:
    """The penalty tables' row stride: both [m, vocab] fp32 CPU, laid out alike, rows contiguous."""
    ld = bias.stride(0) if bias is not None else rep.stride(0) if rep is not None else like.shape[1]
    for t in (bias, rep):
        if t is not None and (t.device.type != "cpu" or t.dtype != torch.float32 or t.shape != like.shape
                              or t.stride() != (ld, 1)):
            raise ValueError(f"a penalty table of {t.dtype} {tuple(t.shape)} with strides {t.stride()} for logits "
                             f"{tuple(like.shape)}")
    return ld


def sample(logits: torch.Tensor, greedy: np.ndarray, host_params: np.ndarray, bias: torch.Tensor | None,
           rep: torch.Tensor | None, seeds: np.ndarray, positions: np.ndarray) -> torch.Tensor:
    """[m] int64 tokens for the m logits rows: greedy rows their penalised argmax, the others
    drawn with temperature, min-p, top-k and top-p (``host_params``: [m, NUM_PARAMS], a row per
    token to draw) from the uniforms of their ``seeds`` and ``positions`` ([m] int64 each);
    ``bias``/``rep`` as in ``SamplingBatch`` (None: no such penalty; with a bias, the repetition
    penalty applies where its entry has a bit set, as the runner's tables are read)."""
    lib = library()
    m, vocab = len(greedy), logits.shape[1]
    _check_logits(logits, m, vocab)
    flags = np.ascontiguousarray(greedy, dtype=np.bool_)
    params = np.ascontiguousarray(host_params, dtype=np.float32)
    _check_params(params, m)
    seeds, positions = _keys(seeds, positions, m)
    out = torch.empty(m, dtype=torch.int64)
    pen_ld = _penalty_ld(bias, rep, logits)
    from_bias = int(bias is not None)
    check(lib, lib.folio_sample(m, vocab, logits.data_ptr(), logits.stride(0), None, m, flags.ctypes.data,
                                params.ctypes.data, params.shape[1], _addr(bias), _addr(rep), from_bias, None, pen_ld,
                                seeds.ctypes.data, positions.ctypes.data, out.data_ptr(),
                                _scratch_for(vocab).ctypes.data))
    return out


def philox_uniforms(seeds: np.ndarray, positions: np.ndarray, first: int, count: int) -> np.ndarray:
    """[n, count] float64: the kernel's draws ``first ..`` for each (seed, position), for the tests."""
    seeds, positions = _keys(seeds, positions, len(seeds))
    out = np.empty((len(seeds), count), dtype=np.float64)
    lib = library()
    check(lib, lib.folio_philox_uniforms(len(seeds), seeds.ctypes.data, positions.ctypes.data, first, count,
                                         out.ctypes.data))
    return out


class TableSampler:
    """``sample`` for rows of the runner's persistent batch, read in place: each logits row's
    parameters are row ``rows[i]`` of the batch's tables, its penalties are read from the penalty
    state's tables and the drawn tokens are recorded there, all in one call. The tables' addresses
    are looked up again only when the batch replaces an array (it grows)."""

    def __init__(self, vocab: int):
        self.vocab = vocab  # the logits' and the penalty tables' width
        self._lib = library()
        if self._lib is None:
            raise RuntimeError("the CPU kernels are unavailable")
        self._tables: tuple = ()
        self._pointers: tuple[int, int] = (0, 0)
        self._scratch = np.empty(_scratch_size(vocab), dtype=np.float32)
        self._scratch_ptr = self._scratch.ctypes.data

    def sample(self, logits: torch.Tensor, rows: torch.Tensor, greedy: np.ndarray, params: np.ndarray,
               penalties, seeds: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """``logits`` [m, vocab] fp32 CPU rows (contiguous within each row); ``rows`` [m] int64
        (contiguous): their rows in ``greedy`` [*] bool and ``params`` [*, NUM_PARAMS] fp32;
        ``penalties``: the rows' ``PenaltyState`` (its tables may be unallocated); ``seeds`` and
        ``positions`` [m] int64: each logits row's key for its uniforms."""
        if logits.shape[1] != self.vocab or penalties.vocab_size != self.vocab:
            raise ValueError(f"logits of width {logits.shape[1]} for a sampler of vocabulary {self.vocab}")
        m = len(rows)
        _check_logits(logits, m, self.vocab)
        if not self._tables or self._tables[0] is not greedy or self._tables[1] is not params:
            if greedy.dtype != np.bool_ or greedy.ndim != 1 or not greedy.flags.c_contiguous:
                raise ValueError(f"greedy flags of {greedy.dtype} {greedy.shape}: a contiguous bool vector")
            _check_params(params, 0)
            self._tables = (greedy, params)
            self._pointers = (greedy.ctypes.data, params.ctypes.data)
        if rows.dtype != torch.int64 or rows.dim() != 1 or not rows.is_contiguous() or rows.device.type != "cpu":
            raise ValueError(f"rows of {rows.dtype} {tuple(rows.shape)} on {rows.device}: a contiguous int64 CPU vector")
        num_rows = min(len(greedy), params.shape[0])
        if penalties.allocated:
            num_rows = min(num_rows, *(_table_rows(t, self.vocab) for t in (penalties.bias, penalties.rep,
                                                                            penalties.counts)))
        _check_rows(rows.numpy(), num_rows)
        seeds, positions = _keys(seeds, positions, m)
        out = torch.empty(m, dtype=torch.int64)
        # the rep table is only written: a seen token's bias entry has a bit set (penalties.py)
        tables = (penalties.bias.data_ptr(), penalties.rep.data_ptr(), 1, penalties.counts.data_ptr()) \
            if penalties.allocated else (None, None, 0, None)
        check(self._lib, self._lib.folio_sample(m, self.vocab, logits.data_ptr(), logits.stride(0), rows.data_ptr(),
                                                num_rows, self._pointers[0], self._pointers[1], params.shape[1],
                                                *tables, self.vocab, seeds.ctypes.data, positions.ctypes.data,
                                                out.data_ptr(), self._scratch_ptr))
        return out


def _table_rows(table: torch.Tensor, vocab: int) -> int:
    """The rows of a penalty table the kernel may index ([rows, vocab], contiguous, on the CPU)."""
    if table.device.type != "cpu" or table.dim() != 2 or table.shape[1] != vocab or not table.is_contiguous() \
            or table.dtype not in (torch.float32, torch.int32):
        raise ValueError(f"a penalty table of {table.dtype} {tuple(table.shape)} for vocabulary {vocab}")
    return table.shape[0]


def exp_nonpositive(x: np.ndarray) -> np.ndarray:
    """The kernel's exp (for x <= 0), elementwise: for the tests."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x)
    lib = library()
    check(lib, lib.folio_exp_nonpositive(x.size, x.ctypes.data, out.ctypes.data))
    return out


def record_penalties(rows: torch.Tensor, token_ids: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor,
                     repetition: torch.Tensor, counts: torch.Tensor, bias: torch.Tensor, rep: torch.Tensor) -> None:
    """``PenaltyState.record`` for CPU tables, in one call: ``rows``, ``token_ids`` and the three
    parameters [n] each; the tables [rows, vocab] (counts int32, bias and rep fp32)."""
    lib = library()
    args = [t.to(dtype).contiguous().reshape(-1) for t, dtype in
            zip((rows, token_ids, frequency, presence, repetition), (torch.int64,) * 2 + (torch.float32,) * 3)]
    if any(t.device.type != "cpu" or len(t) != len(args[0]) for t in args):
        raise ValueError(f"record_penalties: {[tuple(t.shape) for t in args]} (n each, on the CPU)")
    vocab = counts.shape[1] if counts.dim() == 2 else 0
    if counts.dtype != torch.int32 or bias.dtype != torch.float32 or rep.dtype != torch.float32 \
            or not (counts.shape == bias.shape == rep.shape):
        raise ValueError(f"penalty tables {counts.dtype} {tuple(counts.shape)}, {bias.dtype} {tuple(bias.shape)}, "
                         f"{rep.dtype} {tuple(rep.shape)}")
    _check_rows(args[0].numpy(), _table_rows(counts, vocab))
    _check_rows(args[1].numpy(), vocab, "token id")
    for t in (bias, rep):
        _table_rows(t, vocab)
    check(lib, lib.folio_record_penalties(len(args[0]), counts.shape[1], counts.shape[0], *(_addr(t) for t in args),
                                          _addr(counts), _addr(bias), _addr(rep)))
