"""KVPool's block bytes: block_views are the pool's memory, read_blocks/write_blocks round-trip."""

import pytest
import torch

from folio.core.kv.tensors.pool import KVPool, PoolShape


def _pool(dtype=torch.bfloat16, num_blocks=6):
    pool = KVPool(PoolShape(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype), num_blocks,
                  torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for k, v in pool.kv_caches:
        k.copy_(torch.randn(k.shape, generator=g).to(dtype))
        v.copy_(torch.randn(v.shape, generator=g).to(dtype))
    return pool


def test_block_views_are_the_pools_memory():
    pool = _pool()
    views = pool.block_views(2)
    assert len(views) == 6 and all(v.shape == (4, 2, 8) for v in views)
    assert views[0].data_ptr() == pool.kv_caches[0][0][2].data_ptr()  # no copy
    assert views[3].data_ptr() == pool.kv_caches[1][1][2].data_ptr()  # layer 1's V
    views[5].fill_(7)
    assert torch.all(pool.kv_caches[2][1][2] == 7)
    with pytest.raises(IndexError, match="outside"):
        pool.block_views(6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_read_write_round_trip(dtype):
    src, dst = _pool(dtype), _pool(dtype)
    for k, v in dst.kv_caches:
        k.zero_(), v.zero_()
    bufs = src.read_blocks([1, 4])
    assert [b.nbytes for b in bufs] == [src.shape.bytes_per_block] * 2
    # the layout: every layer's K then V, in order
    first = torch.frombuffer(bufs[0], dtype=torch.uint8)[: 4 * 2 * 8 * src.kv_caches[0][0].element_size()]
    assert torch.equal(first, src.kv_caches[0][0][1].reshape(-1).view(torch.uint8))
    dst.write_blocks([3, 0], [bytes(b) for b in bufs])
    for (sk, sv), (dk, dv) in zip(src.kv_caches, dst.kv_caches):
        assert torch.equal(sk[1].view(torch.uint8), dk[3].view(torch.uint8))
        assert torch.equal(sv[4].view(torch.uint8), dv[0].view(torch.uint8))
        assert not dk[1].view(torch.uint8).any()  # untouched
    with pytest.raises(ValueError, match="holds"):
        dst.write_blocks([0], [b"x" * 3])
    with pytest.raises(ValueError, match="buffers"):
        dst.write_blocks([0, 1], [bufs[0]])
