"""The loader's instance table, its errors, and the optional CuPy dependency (no GPU needed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from folio.core.executor.kernels import cuda_kernels as ck


def test_every_configuration_has_its_instances():
    names = ck.all_name_expressions()
    per_dtype = len(ck.HEAD_SIZES) * len(ck.BLOCK_SIZES)
    num_fp8 = len(ck.FP8_ACTIVATION_DTYPES)
    assert len(names["attention"]) == (len(ck.DTYPES) + num_fp8) * per_dtype + len(ck.DTYPES)
    assert len(names["decode"]) == (len(ck.DTYPES) + num_fp8) * per_dtype
    assert len(names["prefill"]) == len(ck.TENSOR_CORE_DTYPES) * per_dtype
    assert len(names["cache"]) == len(ck.DTYPES) + num_fp8 + 1
    for dtype in ck.DTYPES:
        for head in ck.HEAD_SIZES:
            for block in ck.BLOCK_SIZES:
                kn = ck.kernel_names(dtype, head, block)
                for name in (kn.attention, kn.decode, kn.reduce, kn.write_kv, kn.copy_blocks):
                    assert name in names[ck.module_of(name)]
                assert (kn.prefill in names["prefill"]) == (dtype in ck.TENSOR_CORE_DTYPES)
                assert kn.prefill or dtype == "float32"
                if dtype in ck.FP8_ACTIVATION_DTYPES:  # over an fp8 pool: chunks on the CUDA-core kernel
                    k8 = ck.kernel_names(dtype, head, block, fp8=True)
                    for name in (k8.attention, k8.decode, k8.write_kv):
                        assert name in names[ck.module_of(name)] and name.endswith(f", {ck.FP8_CACHE}>")
                    assert k8.prefill == "" and k8.reduce == kn.reduce


@pytest.mark.parametrize(
    "dtype,head,block,pattern",
    [
        ("float16", 80, 16, r"folio::paged_attention<folio::f16, 80, 16>: unsupported head size 80"),
        ("bfloat16", 128, 64, r"unsupported block size 64"),
        ("float8_e4m3fn", 128, 16, r"unsupported dtype float8_e4m3fn"),
        ("float32+fp8", 64, 16, r"paged_attention<float, 64, 16, folio::fp8e4m3>.*float32 over an fp8 pool"),
    ],
)
def test_unsupported_configuration_names_the_missing_instance(dtype, head, block, pattern):
    with pytest.raises(ck.UnsupportedKernelError, match=pattern):
        ck.kernel_names(dtype.removesuffix("+fp8"), head, block, fp8=dtype.endswith("+fp8"))


def test_module_source_inlines_our_headers_once():
    source = ck.module_source("attention")
    assert source.count("struct f16 { unsigned short bits; };") == 1
    assert "paged_attention_reduce" in source


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_cuda_backend_import_fails_cleanly_without_cupy():
    result = _python(
        "import sys; sys.modules['cupy'] = None\n"
        "try:\n    import folio.core.executor.kernels.cuda_backend\nexcept ImportError:\n    print('ImportError')\n"
        "import folio.core.executor.kernels.cuda_kernels, folio.core.executor.kernels.kernel_backend  # these never need CuPy\n"
    )
    assert result.stdout.strip() == "ImportError", result.stderr


def test_runner_falls_back_to_torch_without_cupy():
    result = _python(
        "import sys, torch; sys.modules['cupy'] = None\n"
        "from folio.core.executor.runtime.runner import make_backend\n"
        "print(make_backend('auto', torch.device('cuda'), torch.float16).name)\n"
        "try:\n    make_backend('cuda', torch.device('cuda'), torch.float16)\n"
        "except ValueError as e:\n    print('ValueError', 'unavailable' in str(e))\n"
    )
    assert result.stdout.split() == ["torch", "ValueError", "True"], result.stderr
