"""The sampler's uniforms: counter-based, keyed by (seed, output position, draw index).

Draw ``d`` of a row whose request has seed ``s`` (64 bits) and has generated ``position`` tokens
is Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", 2011; Random123's
round constants) of the counter ``(d, position mod 2**32, position >> 32, 0)`` under the key
``(s mod 2**32, s >> 32)``; its first two output words ``x0, x1`` give the uniform
``((x0 << 21 | x1 >> 11) + 1) * 2**-53`` in (0, 1] (53 bits: exact in float64). Nothing is kept
between draws, so a whole batch's uniforms are computed at once, a row's do not depend on the other
rows, and a request that starts over (preempted, its executor restarted) draws exactly the same.

Three implementations give the same bits (the tests compare them): the C sampler kernel
(``kernels/csrc/sampler.c``), ``uniforms`` below in vectorised torch integer operations (the
reference; int64 tensors holding 32-bit words, whose products wrap as unsigned ones would in
their low 64 bits), and the CUDA kernel ``folio::philox_uniforms`` (``cuda/sampler.cu``), which
``uniforms`` launches for CUDA tensors when CuPy is importable.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["draw_seed", "philox4x32_10", "seed_words", "uniforms"]

M0, M1 = 0xD2511F53, 0xCD9E8D57  # the multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85  # the key schedule's increments
ROUNDS = 10
_LO = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1


def seed_words(seed: int) -> int:
    """A request's seed as the 64-bit key (any Python int: taken modulo 2**64), as a signed
    int64 value (the bits numpy/torch int64 arrays hold)."""
    seed &= _MASK64
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def draw_seed() -> int:
    """A random 64-bit key for a request without a seed, drawn once per request from torch's
    default generator (``torch.manual_seed`` makes it repeatable)."""
    return int(torch.randint(-(1 << 63), (1 << 63) - 1, (1,), dtype=torch.int64).item())


def philox4x32_10(counter: list[torch.Tensor], k0: torch.Tensor, k1: torch.Tensor) -> list[torch.Tensor]:
    """Philox4x32-10 of the four counter words under the key words (int64 tensors of 32-bit
    values, broadcastable); returns the four output words."""
    c0, c1, c2, c3 = counter
    for r in range(ROUNDS):
        if r:
            k0 = (k0 + W0) & _LO
            k1 = (k1 + W1) & _LO
        p0 = c0 * M0  # < 2**64: its low 64 bits wrap in int64 exactly as in uint64
        p1 = c2 * M1
        c0, c1, c2, c3 = ((p1 >> 32) & _LO) ^ c1 ^ k0, p1 & _LO, ((p0 >> 32) & _LO) ^ c3 ^ k1, p0 & _LO
    return [c0, c1, c2, c3]


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """[n, count] float64 on the seeds' device: draws ``first .. first + count - 1`` of each row
    (``seeds`` [n] int64, the 64-bit keys; ``positions`` [n] int64, the rows' output positions)."""
    n = seeds.shape[0]
    if seeds.device.type == "cuda" and n and count:
        from folio.core.executor.kernels import cuda_kernels

        out = cuda_kernels.philox_uniforms(seeds, positions, first, count)
        if out is not None:
            return out
    seeds = seeds.to(torch.int64)[:, None]
    positions = positions.to(device=seeds.device, dtype=torch.int64)[:, None]
    draws = torch.arange(first, first + count, dtype=torch.int64, device=seeds.device)[None, :]
    zero = torch.zeros((), dtype=torch.int64, device=seeds.device)
    x0, x1, _, _ = philox4x32_10([draws, positions & _LO, (positions >> 32) & _LO, zero], seeds & _LO,
                                 (seeds >> 32) & _LO)
    bits = (x0 << 21) | (x1 >> 11)  # 53 bits: no sign to lose
    return (bits + 1).to(torch.float64) * 2.0**-53


def uniforms_np(seeds: np.ndarray, positions: np.ndarray, first: int, count: int) -> np.ndarray:
    """``uniforms`` of host arrays (a convenience for the tests and the host-side callers)."""
    return uniforms(torch.from_numpy(np.ascontiguousarray(seeds, dtype=np.int64)),
                    torch.from_numpy(np.ascontiguousarray(positions, dtype=np.int64)), first, count).numpy()
