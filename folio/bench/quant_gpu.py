"""Quantized projections on a GPU against bf16 ``F.linear``, on the Llama-3.2-1B shape.

One decoder layer's projections (hidden 2048, intermediate 8192, 32 heads, 8 KV heads, head 64:
qkv 2048->3072, o 2048->2048, gate_up 2048->16384, down 8192->2048), summed: microseconds per
layer (CUDA events, median of repeated runs) for bf16, AWQ W4A16 (cuda/quant_gemm.cu, group 128)
at batch 1, 8 and 256, and FP8 weights (``torch._scaled_mm``, sm_89+ only) at batch 1 and 256,
with each mode's speedup over bf16 in the same run. The issue's targets: AWQ at batch 1 at least
2x bf16; FP8 at batch 256 at least 1.3x.

    python scripts/bench_quant_gpu.py [--json FILE] [--device cpu]

``--device cpu`` runs a layer a sixteenth of that shape through the launcher ``main`` is given (the
CUDA emulation, in ``scripts/gpu_check.sh --dry-run``), timed by the wall clock: a check that the
benchmark runs, not a figure.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from folio.core.executor.quant.formats import quantize_int4
from folio.core.executor.quant.gpu import AwqLinear, Fp8Linear, cupy_launcher
from folio.bench.fused import time_us

HIDDEN, INTER, Q_SIZE, KV_SIZE = 2048, 8192, 2048, 512


def layer_shapes(scale: int = 1) -> dict[str, tuple[int, int]]:
    """One layer's projections, name -> (out, in), every size divided by ``scale``."""
    hidden, inter, q_size, kv_size = (size // scale for size in (HIDDEN, INTER, Q_SIZE, KV_SIZE))
    return {"qkv": (q_size + 2 * kv_size, hidden), "o": (hidden, q_size), "gate_up": (2 * inter, hidden),
            "down": (hidden, inter)}


SHAPES = layer_shapes()


def main(argv: list[str] | None = None, launcher=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    if not on_gpu and launcher is None:
        parser.error("--device cpu needs a launcher of the W4A16 kernel (tests/cuda/emulated_bench.py passes the "
                     "CUDA emulation's)")
    launcher = launcher or cupy_launcher(device)
    fp8 = on_gpu and torch.cuda.get_device_capability() >= (8, 9)
    shapes, batches, repeats = (SHAPES, (1, 8, 256), 50) if on_gpu else (layer_shapes(16), (1,), 1)
    layers = {}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k) * 0.02
        layers[name] = dict(k=k, bf16=w.to(device, torch.bfloat16),
                            awq=AwqLinear(quantize_int4(w, args.group_size), None, launcher, device),
                            fp8=Fp8Linear(w.to(device, torch.bfloat16)) if fp8 else None)
    device_name = torch.cuda.get_device_name() if on_gpu else "cpu (the launcher given)"
    print(f"{device_name}: one {'1B' if on_gpu else '1B/16'}-shape layer's projections, bf16 activations")
    print(f"{'mode':>5} {'batch':>5} {'bf16 us':>8} {'quant us':>9} {'speedup':>8}")
    rows = []
    modes = [("awq", b) for b in batches] + ([("fp8", 1), ("fp8", 256)] if fp8 else [])

    def save() -> None:  # after every row: a run cut short keeps what it measured
        if args.json:
            Path(args.json).write_text(json.dumps({"device": device_name, "rows": rows}, indent=1))

    for mode, batch in modes:
        xs = {name: torch.randn(batch, layer["k"], device=device, dtype=torch.bfloat16)
              for name, layer in layers.items()}
        t_ref = sum(time_us(lambda x=xs[name], w=layer["bf16"]: F.linear(x, w), repeats, args.device)
                    for name, layer in layers.items())
        t_q = sum(time_us(lambda x=xs[name], f=layer[mode]: f(x), repeats, args.device)
                  for name, layer in layers.items())
        rows.append(dict(mode=mode, batch=batch, bf16_us=t_ref, quant_us=t_q, speedup=t_ref / t_q))
        save()
        print(f"{mode:>5} {batch:>5} {t_ref:>8.1f} {t_q:>9.1f} {t_ref / t_q:>7.2f}x", flush=True)
    if on_gpu and not fp8:
        print(f"fp8: not run (compute capability {torch.cuda.get_device_capability()} < 8.9)")
    save()


if __name__ == "__main__":
    main()
