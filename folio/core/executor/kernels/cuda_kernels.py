"""Loader for the CUDA kernels in ``cuda/`` (installed: the package data of ``folio.cuda``): sources, compile options, template instances.

The ``cuda`` attention backend asks this module for the kernel instances that fit a model (dtype,
head size, block size); it compiles each module once per process with CuPy's ``RawModule``
(NVRTC, whose binaries CuPy also caches on disk, under ``~/.cupy/kernel_cache`` or
``$CUPY_CACHE_DIR``) and hands back launchable kernels. The compile tests and the CPU emulation
use the same sources, options and name expressions from here, so that what CI checks is what a
GPU runs. Importing this module never needs CuPy; only ``compiled_kernel`` does.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

import folio.cuda

KERNEL_DIR = Path(folio.cuda.__file__).resolve().parent  # cuda/ in a checkout, folio/cuda installed

# module name -> source file; each module is compiled separately (only the instances a model needs)
MODULE_FILES = {"attention": "paged_attention.cu", "decode": "decode_attention.cu", "prefill": "prefill_attention.cu",
                "cache": "cache_ops.cu", "fused": "fused_ops.cu", "quant": "quant_gemm.cu", "gemm": "dense_gemm.cu"}

# storage dtype name (torch's) -> C++ type in the kernels
DTYPES = {"float32": "float", "float16": "folio::f16", "bfloat16": "folio::bf16"}
# an fp8 KV pool (--kv-cache-dtype fp8): its C++ element type, and the activation dtypes whose
# kernels have an fp8-pool instance (GPUs serve 16-bit models; fp32 ones take the torch backend)
FP8_CACHE = "folio::fp8e4m3"
FP8_ACTIVATION_DTYPES = ("float16", "bfloat16")
HEAD_SIZES = (64, 96, 128)
BLOCK_SIZES = (8, 16, 32)

# Mirrors constants of cuda/paged_attention.cu and cuda/decode_attention.cu (the tests check they agree).
ATTN_THREADS = 128
ATTN_ROWS = 8
DECODE_THREADS = 128
DECODE_MAX_GROUP = 16
PREFILL_THREADS = 128
PREFILL_ROWS = 64
TENSOR_CORE_DTYPES = ("float16", "bfloat16")  # the prefill kernel's mma.sync types
PARTITION_SIZE = 512
REDUCE_THREADS = 128
WRITE_THREADS = 128
COPY_THREADS = 256
NORM_THREADS = 256
ACT_THREADS = 256
ROPE_THREADS = 128
# cuda/quant_gemm.cu (the W4A16 kernels over AutoAWQ's GEMM layout)
GEMV_THREADS = 256
GEMV_ROWS = 2
GEMV_COLS = 256
GEMV_K = 256
GEMM_THREADS = 256
GEMM_BM = 32
GEMM_BN = 128
GEMM_BK = 32
QUANT_DTYPES = ("float32", "float16", "bfloat16")  # activation types of the W4A16 kernels
# cuda/dense_gemm.cu (the batch-invariant dense GEMM on tensor cores)
DGEMM_THREADS = 128
DGEMM_TILE_M = 64
DGEMM_TILE_N = 64
DGEMM_DTYPES = ("float16", "bfloat16")

# Our options. CuPy's RawModule adds its own (see cupy_nvrtc_options); -std=c++17 for constexpr
# and alignas; no --use_fast_math: the kernels call __expf where they want the fast exponential.
NVRTC_OPTIONS = ("-std=c++17",)


class UnsupportedKernelError(ValueError):
    """The model needs a kernel instance that the loader does not build."""


@dataclass(frozen=True)
class KernelNames:
    """Name expressions (template instances) of every kernel one model configuration launches."""

    attention: str
    decode: str
    prefill: str  # "" where no tensor-core instance exists (fp32): chunks take the attention kernel
    reduce: str
    write_kv: str
    copy_blocks: str


def _cache_arg(fp8: bool) -> str:
    return f", {FP8_CACHE}" if fp8 else ""


def attention_name(dtype: str, head_size: int, block_size: int, fp8: bool = False) -> str:
    return f"folio::paged_attention<{DTYPES[dtype]}, {head_size}, {block_size}{_cache_arg(fp8)}>"


def decode_name(dtype: str, head_size: int, block_size: int, fp8: bool = False) -> str:
    return f"folio::paged_decode<{DTYPES[dtype]}, {head_size}, {block_size}{_cache_arg(fp8)}>"


def prefill_name(dtype: str, head_size: int, block_size: int) -> str:
    return f"folio::paged_prefill<{DTYPES[dtype]}, {head_size}, {block_size}>"


def reduce_name(dtype: str) -> str:
    return f"folio::paged_attention_reduce<{DTYPES[dtype]}>"


def write_kv_name(dtype: str, fp8: bool = False) -> str:
    return f"folio::write_kv<{DTYPES[dtype]}{_cache_arg(fp8)}>"


def built_type(dtype: str, built, what: str) -> str:
    """The C type of ``dtype`` for kernels built for the dtypes ``built``, or the error naming them."""
    if dtype not in built:
        raise UnsupportedKernelError(f"no {what} for dtype {dtype} (built: {', '.join(built)})")
    return DTYPES[dtype]


COPY_BLOCKS_NAME = "folio::copy_blocks"
FUSED_KERNELS = ("add_rms_norm", "silu_and_mul", "rope_write_kv", "gelu_tanh_and_mul")  # cuda/fused_ops.cu, templated on T


@dataclass(frozen=True)
class FusedNames:
    """Name expressions of the fused elementwise kernels for one dtype."""

    add_rms_norm: str
    silu_and_mul: str
    rope_write_kv: str
    gelu_tanh_and_mul: str


def fused_names(dtype: str) -> FusedNames:
    t = built_type(dtype, DTYPES, "fused kernels")
    return FusedNames(*(f"folio::{kernel}<{t}>" for kernel in FUSED_KERNELS))


def rope_write_kv_fp8_name(dtype: str) -> str:
    """The fused RoPE + KV write into an fp8 pool (its rotation, scales and K shift applied)."""
    return f"folio::rope_write_kv<{DTYPES[dtype]}, {FP8_CACHE}>"


QUANT_KERNELS = ("awq_gemv", "awq_gemm")  # cuda/quant_gemm.cu, templated on the activation type


@dataclass(frozen=True)
class QuantNames:
    """Name expressions of the W4A16 kernels for one activation dtype."""

    awq_gemv: str
    awq_gemm: str


def quant_names(dtype: str) -> QuantNames:
    t = built_type(dtype, QUANT_DTYPES, "W4A16 kernels for activations")
    return QuantNames(*(f"folio::{kernel}<{t}>" for kernel in QUANT_KERNELS))


@dataclass(frozen=True)
class GemmNames:
    """Name expression of the batch-invariant dense GEMM for one dtype."""

    dense_gemm: str


def gemm_names(dtype: str) -> GemmNames:
    return GemmNames(f"folio::dense_gemm<{built_type(dtype, DGEMM_DTYPES, 'batch-invariant GEMM')}>")


@functools.cache  # asked once per layer and step
def kernel_names(dtype: str, head_size: int, block_size: int, fp8: bool = False) -> KernelNames:
    """The instances for one configuration (``fp8``: over an fp8 pool), or an error that names the
    one that is missing."""
    problems = []
    if dtype not in DTYPES:
        problems.append(f"dtype {dtype} (built: {', '.join(DTYPES)})")
    elif fp8 and dtype not in FP8_ACTIVATION_DTYPES:
        problems.append(f"dtype {dtype} over an fp8 pool (built: {', '.join(FP8_ACTIVATION_DTYPES)})")
    if head_size not in HEAD_SIZES:
        problems.append(f"head size {head_size} (built: {HEAD_SIZES})")
    if block_size not in BLOCK_SIZES:
        problems.append(f"block size {block_size} (built: {BLOCK_SIZES})")
    if problems:
        wanted = f"folio::paged_attention<{DTYPES.get(dtype, dtype)}, {head_size}, {block_size}{_cache_arg(fp8)}>"
        raise UnsupportedKernelError(
            f"no CUDA kernel instance {wanted}: unsupported {'; '.join(problems)}. "
            "Use --attention-backend torch, or add the instance to folio/core/executor/kernels/cuda_kernels.py"
        )
    return KernelNames(
        attention=attention_name(dtype, head_size, block_size, fp8),
        decode=decode_name(dtype, head_size, block_size, fp8),
        # an fp8 pool's chunks take the CUDA-core kernel (the tensor-core one reads T tiles)
        prefill=prefill_name(dtype, head_size, block_size) if dtype in TENSOR_CORE_DTYPES and not fp8 else "",
        reduce=reduce_name(dtype),
        write_kv=write_kv_name(dtype, fp8),
        copy_blocks=COPY_BLOCKS_NAME,
    )


def module_of(name: str) -> str:
    base = name.split("<")[0].removeprefix("folio::")
    if base in FUSED_KERNELS:
        return "fused"
    if base in QUANT_KERNELS:
        return "quant"
    if base == "dense_gemm":
        return "gemm"
    if name.startswith("folio::paged_decode"):
        return "decode"
    if name.startswith("folio::paged_prefill"):
        return "prefill"
    return "attention" if name.startswith("folio::paged_attention") else "cache"


def all_name_expressions() -> dict[str, list[str]]:
    """Every instance the loader can ask for, by module (what the compile tests build)."""
    names: dict[str, list[str]] = {module: [] for module in MODULE_FILES}
    for dtype in DTYPES:
        for head in HEAD_SIZES:
            for block in BLOCK_SIZES:
                names["attention"].append(attention_name(dtype, head, block))
                names["decode"].append(decode_name(dtype, head, block))
                if dtype in TENSOR_CORE_DTYPES:
                    names["prefill"].append(prefill_name(dtype, head, block))
                if dtype in FP8_ACTIVATION_DTYPES:
                    names["attention"].append(attention_name(dtype, head, block, fp8=True))
                    names["decode"].append(decode_name(dtype, head, block, fp8=True))
        names["attention"].append(reduce_name(dtype))
        names["cache"].append(write_kv_name(dtype))
        if dtype in FP8_ACTIVATION_DTYPES:
            names["cache"].append(write_kv_name(dtype, fp8=True))
        names["fused"].extend(vars(fused_names(dtype)).values())
        if dtype in FP8_ACTIVATION_DTYPES:
            names["fused"].append(rope_write_kv_fp8_name(dtype))
        names["quant"].extend(vars(quant_names(dtype)).values())
        if dtype in DGEMM_DTYPES:
            names["gemm"].extend(vars(gemm_names(dtype)).values())
    names["cache"].append(COPY_BLOCKS_NAME)
    return names


_INCLUDE = re.compile(r'^#include "([^"]+)"\s*$', re.MULTILINE)


def module_source(module: str) -> str:
    """The loader's module ``module`` (a ``MODULE_FILES`` key) as ``source_of`` gives it."""
    return source_of(MODULE_FILES[module])


@functools.cache
def source_of(filename: str) -> str:
    """A kernel file of ``cuda/`` with our own headers inlined (every module: the loader's, and
    ``moe_kernels``' and ``lora_kernels``' own).

    Inlining (rather than ``-I cuda``) makes the source text complete, so CuPy's on-disk cache,
    keyed by source and options, notices a change in a header too.
    """
    seen: set[str] = set()

    def expand(path: Path) -> str:
        def include(match: re.Match) -> str:
            header = match.group(1)
            if header in seen:
                return ""
            seen.add(header)
            return expand(KERNEL_DIR / header)

        return _INCLUDE.sub(include, path.read_text())

    return expand(KERNEL_DIR / filename)


def cupy_nvrtc_options(arch: str) -> tuple[str, ...]:
    """The full NVRTC option list CuPy 14's RawModule uses for our options on ``sm_<arch>``.

    CuPy appends ``-ftz=true``, then ``-arch=sm_XX`` (cubin), then
    ``--device-as-default-execution-space`` (cupy/cuda/compiler.py). Tests compile with these so
    that what passes in CI is what a GPU compiles.
    """
    return NVRTC_OPTIONS + ("-ftz=true", f"-arch=sm_{arch}", "--device-as-default-execution-space")


@functools.cache
def raw_module(filename: str, names: tuple[str, ...], device_id: int):
    """``filename`` compiled (NVRTC, through CuPy) with the instances ``names``, once per process."""
    import cupy  # optional dependency: only a GPU run gets here

    with cupy.cuda.Device(device_id):
        mod = cupy.RawModule(code=source_of(filename), options=NVRTC_OPTIONS, name_expressions=list(names))
        mod.compile()
    return mod


def compiled_kernel(name: str, names: KernelNames | FusedNames | QuantNames | GemmNames, device_id: int):
    """A launchable ``cupy.RawKernel`` for ``name``; compiles its module (with the configuration's
    other instances of that module) on first use in this process."""
    module = module_of(name)
    wanted = tuple(sorted({n for n in vars(names).values() if n and module_of(n) == module}))
    if name not in wanted:
        raise UnsupportedKernelError(f"kernel instance {name} is not part of {names}")
    return raw_module(MODULE_FILES[module], wanted, device_id).get_function(name)


# cuda/sampler.cu: the sampler's uniforms (a module of its own; sampling/philox.py asks for it)
SAMPLER_FILE = "sampler.cu"
PHILOX_UNIFORMS_NAME = "folio::philox_uniforms"
PHILOX_THREADS = 128  # cuda/sampler.cu's PHILOX_THREADS


def philox_launch(seeds, positions, out, first: int, count: int):
    """(grid, block, args) of ``folio::philox_uniforms`` filling ``out`` [n, count] float64 from
    ``seeds`` and ``positions`` ([n] int64, contiguous, on out's device): the GPU and the emulation
    tests marshal it with this same code."""
    import numpy as np

    total = seeds.shape[0] * count
    grid = (max(1, -(-total // PHILOX_THREADS)), 1, 1)
    args = (np.uint64(seeds.data_ptr()), np.uint64(positions.data_ptr()), np.uint64(out.data_ptr()),
            np.int64(seeds.shape[0]), np.int32(first), np.int32(count))
    return grid, (PHILOX_THREADS, 1, 1), args


def philox_uniforms(seeds, positions, first: int, count: int):
    """[n, count] float64 draws ``first ..`` of each (seed, position) computed on the GPU by
    ``cuda/sampler.cu`` on torch's current stream; None when CuPy is not importable (the caller
    then computes them with torch)."""
    try:
        import cupy
    except ImportError:
        return None
    import torch

    device = seeds.device
    device_id = device.index if device.index is not None else torch.cuda.current_device()
    seeds = seeds.to(torch.int64).contiguous()
    positions = positions.to(device=device, dtype=torch.int64).contiguous()
    out = torch.empty((seeds.shape[0], count), dtype=torch.float64, device=device)
    grid, block, args = philox_launch(seeds, positions, out, first, count)
    function = raw_module(SAMPLER_FILE, (PHILOX_UNIFORMS_NAME,), device_id).get_function(PHILOX_UNIFORMS_NAME)
    with cupy.cuda.Device(device_id), cupy.cuda.ExternalStream(torch.cuda.current_stream(device_id).cuda_stream):
        function(grid, block, args)
    return out
