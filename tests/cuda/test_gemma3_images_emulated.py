"""Gemma 3's images on the CUDA kernel backend (its emulated kernels): refused at start with the
reason, since the kernels do not attend an image's placeholders both ways; the torch backend,
which does, passes the same check."""

from __future__ import annotations

import pytest

from folio.core.executor.kernels.kernel_backend import KernelAttentionBackend
from folio.core.executor.runtime.runner import ModelRunner
from folio.shared.config import RuntimeConfig
from folio.testing.models import write_tiny_gemma3_vlm_model


def test_the_kernel_backend_refuses_gemma3_images(tmp_path, smollm_tokenizer_dir, emu_launcher):
    folder = write_tiny_gemma3_vlm_model(tmp_path / "gemma3-vlm", smollm_tokenizer_dir)
    runner = ModelRunner(RuntimeConfig(device="cpu", dtype="float32", num_kv_blocks=16, attention_backend="torch"),
                         folder)
    runner._check_whole_images()  # the torch backend attends image spans
    runner.backend = KernelAttentionBackend(emu_launcher, runner.dtype)
    with pytest.raises(ValueError, match="gemma3 images attend their placeholders both ways, which the .* does not"):
        runner._check_whole_images()
