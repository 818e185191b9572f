"""The CPU's quantized GEMM per GGUF type: weight GB/s against this machine's read bandwidth, and
integer throughput as rows grow (a step of 1 row is memory-bound, of hundreds compute-bound).

    folio bench cpu_gemm [--types Q4_0 Q4_K ...] [--rows 1 2 4 8 16 32 256] [--shape 1b|smollm2] [--threads N]

For each type, the projections of one decoder layer of the shape (random blocks: speed does not
depend on the values), each timed over repeated calls after a warm-up; prints ``label: value``
lines (``folio bench`` collects them): ms per layer, weight GB/s and its share of the read
bandwidth measured here (a sum over 256 MB, all threads), and GMAC/s. A layer's weights are
larger than the last-level cache for the 1B shape, so each call streams them from memory.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

SHAPES = {  # (hidden, intermediate, q heads, kv heads, head_dim)
    "smollm2": (576, 1536, 9, 3, 64),
    "1b": (2048, 8192, 32, 8, 64),
    "3b": (3072, 8192, 24, 8, 128),
}
DEFAULT_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")


def read_bandwidth(threads: int) -> float:
    """GB/s of a sum over 256 MB (read only), best of 5."""
    torch.set_num_threads(threads)
    a = torch.ones(64 * 1024 * 1024)
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        a.sum()
        best = max(best, a.nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def layer_weights(name: str, shape: tuple, rng: np.random.Generator):
    """The four projections of a layer (qkv, o, gate_up, down) as random ``name`` blocks, or None
    when the shape's inputs are not whole units of the type."""
    from folio.core.executor.quant.cpu_gemm import UNITS, PackedWeight
    from folio.testing.gguf_blocks import random_blocks

    hidden, inter, heads, kv_heads, hd = shape
    dims = [((heads + 2 * kv_heads) * hd, hidden), (hidden, heads * hd), (2 * inter, hidden), (hidden, inter)]
    if any(k % UNITS[name] for _, k in dims):
        return None
    return [PackedWeight.from_gguf(name, random_blocks(name, n, k, rng), k) for n, k in dims]


def time_layer(gemms, inputs, repeats: int) -> float:
    """Seconds for one pass over the layer's GEMMs, the fastest of ``repeats``."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for g, x in zip(gemms, inputs):
            g(x)
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    from folio.core.executor.kernels import cpu_kernels
    from folio.core.executor.quant.cpu_gemm import QGemm

    parser = argparse.ArgumentParser(prog="folio bench cpu_gemm", description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=list(DEFAULT_TYPES))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 9, 16, 32, 256])
    parser.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--passes", type=int, default=2, choices=(1, 2))
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    lib = cpu_kernels.library()
    if lib is None:
        raise SystemExit("the CPU kernels cannot be built here")
    lib.folio_set_threads(args.threads)
    bandwidth = read_bandwidth(args.threads)
    print(f"kernel path: {lib.folio_gemm_path().decode()}, {args.threads} threads, shape {args.shape}, "
          f"{args.passes} activation pass(es)")
    print(f"read bandwidth: {bandwidth:.1f} GB/s")
    rng = np.random.default_rng(0)
    shape = SHAPES[args.shape]
    for name in args.types:
        weights = layer_weights(name, shape, rng)
        if weights is None:
            print(f"{name}: the shape's inputs are not whole units of the type")
            continue
        nbytes = sum(w.nbytes for w in weights)
        macs = sum(w.n * w.k for w in weights)
        gemms = [QGemm(w, args.passes) for w in weights]
        for m in args.rows:
            inputs = [torch.randn(m, w.k) for w in weights]
            time_layer(gemms, inputs, 2)
            s = time_layer(gemms, inputs, args.repeats if m <= 32 else max(3, args.repeats // 5))
            gbs = nbytes / s / 1e9
            print("\n".join(f"{name} rows {m} {label}: {value}" for label, value in (
                ("ms", f"{s * 1e3:.3f}"), ("GB/s", f"{gbs:.1f} ({gbs / bandwidth:.0%} of read)"),
                ("GMAC/s", f"{m * macs / s / 1e9:.1f}"))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
