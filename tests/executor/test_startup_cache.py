"""Start-up caches: the C kernels are compiled once per source, flags and CPU (a second build finds the
file and runs no compiler), and a quantized CPU model is built once and mapped back from the
prepared-model cache (the same tensors, a new checkpoint file a new entry); the phases are timed."""

from __future__ import annotations

import os

import pytest
import torch

from folio.core.executor.kernels import cpu_kernels
from folio.core.executor.quant.cpu_gemm import PackedWeight
from folio.core.executor.model import loader
from folio.core.kv.tensors.pool import KVPool, PoolShape
from folio.services.serve import startup_breakdown
from folio.core.executor import startup
from folio.core.executor.kernels.toolchain import c_compiler
from folio.testing.models import write_tiny_model


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FOLIO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FOLIO_MODEL_CACHE", raising=False)
    return tmp_path / "cache"


@pytest.mark.skipif(c_compiler() is None, reason="no C compiler")
def test_a_second_kernel_build_reuses_the_compiled_file(cache):
    flags = tuple("-O0" if f == "-O3" else f for f in cpu_kernels.FLAGS)  # the cache, not the code: a quick build
    before = cpu_kernels.num_compiles
    first = cpu_kernels._compile(flags)
    assert cpu_kernels.num_compiles == before + 1 and first.parent == cache / "cpu-kernels"
    stamp = first.stat().st_mtime_ns
    second = cpu_kernels._compile(flags)
    assert second == first and cpu_kernels.num_compiles == before + 1  # found, not compiled again
    assert second.stat().st_mtime_ns == stamp and startup.NOTES["kernels_cache"] == "hit"


def _tensors(model) -> dict[str, torch.Tensor]:
    """Every tensor the modules hold, buffers, parameters and plain attributes (packed weights) alike."""
    out = {}
    for name, module in model.named_modules():
        for key, value in vars(module).items():
            if isinstance(value, torch.Tensor):
                out[f"{name}.{key}"] = value
            elif isinstance(value, PackedWeight):  # a quantized weight's tiles, part by part
                out.update({f"{name}.{key}.{i}": part.tiles for i, part in enumerate(value.parts)})
        for key, value in [*module._parameters.items(), *module._buffers.items()]:
            if value is not None:
                out[f"{name}.{key}"] = value
    return out


def test_a_quantized_model_is_built_once_then_mapped_from_the_cache(cache, tmp_path, monkeypatch):
    monkeypatch.setattr(loader, "PREPARED_MIN_BUILD_S", 0.0)  # the tiny model builds in milliseconds
    folder = tmp_path / "tiny"
    write_tiny_model(folder, "llama")
    cpu = torch.device("cpu")
    built = loader.load_model(folder, torch.float32, cpu, "int4")
    assert startup.NOTES["weights_cache"] == "miss"
    (entry,) = (cache / "prepared").glob("*.pt")
    cached = loader.load_model(folder, torch.float32, cpu, "int4")
    assert startup.NOTES["weights_cache"] == "hit" and cached is not built and cached.quantization == "int4"
    a, b = _tensors(built), _tensors(cached)
    assert a.keys() == b.keys() and len(a) > 10
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert cached.hf_config.num_hidden_layers == built.hf_config.num_hidden_layers  # rebuilt on use
    # another method, or a changed checkpoint: another entry
    loader.load_model(folder, torch.float32, cpu, "int8")
    assert len(list((cache / "prepared").glob("*.pt"))) == 2
    (folder / "config.json").touch()
    os.utime(folder / "config.json", ns=(1, 1))
    loader.load_model(folder, torch.float32, cpu, "int4")
    assert startup.NOTES["weights_cache"] == "miss" and entry.exists()
    monkeypatch.setenv("FOLIO_MODEL_CACHE", "0")
    assert loader.prepared_entry(folder, torch.float32, cpu, "int4", 32) is None


def test_an_unreadable_entry_is_rebuilt(cache, tmp_path, monkeypatch):
    monkeypatch.setattr(loader, "PREPARED_MIN_BUILD_S", 0.0)
    folder = tmp_path / "tiny"
    write_tiny_model(folder, "llama")
    cpu = torch.device("cpu")
    entry = loader.prepared_entry(folder, torch.float32, cpu, "int8", 32)
    entry.parent.mkdir(parents=True)
    entry.write_bytes(b"not a model")
    model = loader.load_model(folder, torch.float32, cpu, "int8")
    assert model.quantization == "int8" and startup.NOTES["weights_cache"] == "unreadable"
    assert loader.load_model(folder, torch.float32, cpu, "int8").quantization == "int8"
    assert startup.NOTES["weights_cache"] == "hit"


def test_the_cpu_pool_is_zeroed_without_touching_it_at_start():
    shape = PoolShape(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    pool = KVPool(shape, 10, torch.device("cpu"))
    k, v = pool.kv_caches[1]
    assert k.shape == (10, 4, 2, 8) and k.dtype == torch.bfloat16 and k.is_contiguous()
    assert not k.any() and not v.any() and k.data_ptr() != v.data_ptr()
    k[3, 1] = 1.5
    assert k.sum().item() == 1.5 * 16 and not v.any()


def test_the_breakdown_line_names_every_phase():
    line = startup_breakdown(7.4, {"kvmanager": 0.9, "executor": 4.2, "scheduler": 4.1, "tokenizer": 7.3,
                                   "gateway": 2.0},
                             {"phases": {"imports": 3.0, "weights": 0.1, "pool": 0.01}, "ready_s": 4.0,
                              "notes": {"weights_cache": "hit"}})
    assert line.startswith("start-up 7.4 s to a healthy /health; services ready: kvmanager 0.9 s, executor 4.2 s")
    assert "executor 4.0 s: imports 3.00, weights 0.10 (cache hit), pool 0.01, kernels 0.00, graphs 0.00, " \
           "other 0.89" in line
