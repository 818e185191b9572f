"""KV transfer between two pools over tcp (ZeroMQ frames), the layout handshake, the records."""

import time

import msgspec
import pytest
import torch
import zmq

from folio.core.kv.tensors.pool import KVPool, PoolShape
from folio.core.kv.tensors.transfer import KVLayout, LayoutMismatch, TransferError, TransferHandle
from folio.services.executor.kv_sockets import KVReceiver, KVSender
from folio.core.kv.allocator import BlockAllocator
from folio.shared.curve import secure


def _pool(dtype=torch.bfloat16, num_blocks=8, seed=0, **kw):
    dims = {"num_layers": 3, "block_size": 4, "num_kv_heads": 2, "head_dim": 8, **kw}
    pool = KVPool(PoolShape(dtype=dtype, **dims), num_blocks, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    for k, v in pool.kv_caches:
        k.copy_(torch.randn(k.shape, generator=g).to(dtype))
        v.copy_(torch.randn(v.shape, generator=g).to(dtype))
    return pool


@pytest.fixture
def released():
    return []


def _sender(pool, released, **kw):
    return KVSender(pool, KVLayout.of(pool, kw.pop("kv_scales", None)),
                    on_release=lambda tid, ids, ok: released.append((tid, ids, ok)), **kw)


@pytest.mark.parametrize("dtype,scales", [(torch.bfloat16, None), (torch.float8_e4m3fn, [(0.5, 0.25)] * 3)])
def test_blocks_move_over_tcp_and_are_released_on_confirm(dtype, scales, released):
    src, dst = _pool(dtype, seed=1), _pool(dtype, seed=2)
    sender = _sender(src, released, kv_scales=scales)
    try:
        assert sender.endpoint.startswith("tcp://127.0.0.1:")
        handle = sender.export([5, 1, 6], num_tokens=11)
        assert sender.outstanding[handle.transfer_id][0] == [5, 1, 6] and not released  # owned until confirmed
        wire = TransferHandle.from_wire(handle.to_wire())
        moved = KVReceiver(dst, KVLayout.of(dst, scales)).pull(wire, [0, 2, 3])
        assert moved == 3 * src.shape.bytes_per_block
        for (sk, sv), (dk, dv) in zip(src.kv_caches, dst.kv_caches):
            for s, d in ((5, 0), (1, 2), (6, 3)):
                assert torch.equal(sk[s].view(torch.uint8), dk[d].view(torch.uint8))
                assert torch.equal(sv[s].view(torch.uint8), dv[d].view(torch.uint8))
        assert released == [(handle.transfer_id, [5, 1, 6], True)] and not sender.outstanding
        # a released transfer cannot be pulled again
        with pytest.raises(TransferError, match="not outstanding"):
            KVReceiver(dst, KVLayout.of(dst, scales)).pull(handle, [0, 2, 3])
    finally:
        sender.close()


@pytest.mark.parametrize("change,named", [
    ({"dtype": torch.float16}, "dtype: bfloat16 vs float16"),
    ({"block_size": 8}, "block_size: 4 vs 8"),
    ({"num_kv_heads": 1}, "num_kv_heads: 2 vs 1"),
    ({"head_dim": 16}, "head_dim: 8 vs 16"),
    ({"num_layers": 2}, "num_layers: 3 vs 2"),
    ({"kv_scales": [(0.5, 0.25)] * 3}, "fp8 scales"),
])
def test_a_layout_mismatch_is_refused_naming_the_difference(change, named, released):
    src = _pool()
    sender = _sender(src, released)
    try:
        handle = sender.export([0, 1])
        scales = change.pop("kv_scales", None)
        other = _pool(change.pop("dtype", torch.bfloat16), **change)
        with pytest.raises(LayoutMismatch, match=named.replace("(", r"\(")):
            KVReceiver(other, KVLayout.of(other, scales)).pull(handle, [0, 1])
        assert handle.transfer_id in sender.outstanding and not released  # still the request's
        assert sender.counts["refused"] == 1
    finally:
        sender.close()


def test_fp8_scales_that_differ_name_the_layers():
    a = KVLayout("float8_e4m3fn", 16, 2, 64, 3, ((1.0, 1.0), (1.0, 1.0), (1.0, 1.0)))
    b = KVLayout("float8_e4m3fn", 16, 2, 64, 3, ((1.0, 1.0), (2.0, 1.0), (1.0, 1.0)))
    assert a.differences(b) == ["fp8 scales: differ at layers [1]"] and a.differences(a) == []


def test_a_failed_transfer_frees_the_blocks_in_the_owners_records():
    """The owner of record (the kvmanager's allocator) gets the blocks back when the pull fails."""
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    alloc.allocate("req-1", 10)
    ids = alloc.block_table("req-1")
    assert alloc.num_free_blocks == 5
    src, dst = _pool(), _pool()
    sender = KVSender(src, KVLayout.of(src), on_release=lambda tid, blocks, ok: alloc.free("req-1"))
    try:
        handle = sender.export(ids)
        receiver = KVReceiver(dst, KVLayout.of(dst))
        receiver._land = lambda *a: (_ for _ in ()).throw(OSError("the decode pool went away"))
        with pytest.raises(TransferError, match="went away"):
            receiver.pull(handle, [0, 1, 2])
        deadline = time.monotonic() + 5
        while sender.outstanding and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not sender.outstanding and sender.counts["failed"] == 1
        assert alloc.num_free_blocks == 8 and "req-1" not in alloc.seqs
    finally:
        sender.close()


def test_an_unconfirmed_transfer_expires_and_is_freed(released):
    sender = _sender(_pool(), released, ttl_s=0.05)
    try:
        handle = sender.export([2])
        deadline = time.monotonic() + 5
        while not released and time.monotonic() < deadline:
            time.sleep(0.02)
        assert released == [(handle.transfer_id, [2], False)] and sender.counts["expired"] == 1
    finally:
        sender.close()


def test_a_dead_sender_is_a_transfer_error():
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.ROUTER)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    s.close(0)  # nobody answers there now
    dst = _pool()
    handle = TransferHandle(transfer_id="x", endpoint=f"tcp://127.0.0.1:{port}", num_blocks=1)
    with pytest.raises(TransferError, match="no answer"):
        KVReceiver(dst, KVLayout.of(dst), timeout_s=0.2).pull(handle, [0])


def test_handles_are_validated():
    with pytest.raises(ValueError, match="invalid kv transfer handle"):
        TransferHandle.from_wire({"transfer_id": "a", "endpoint": "tcp://h:1"})
    with pytest.raises(ValueError, match="not a ZeroMQ address"):
        TransferHandle.from_wire({"transfer_id": "a", "endpoint": "http://h:1", "num_blocks": 1})
    with pytest.raises(ValueError, match="negative"):
        TransferHandle.from_wire({"transfer_id": "a", "endpoint": "tcp://h:1", "num_blocks": -1})
    with pytest.raises(ValueError, match="blocks"):
        KVReceiver(_pool(), KVLayout.of(_pool())).pull(
            TransferHandle(transfer_id="a", endpoint="tcp://127.0.0.1:1", num_blocks=2), [0])


def test_a_malformed_request_is_answered_and_the_sender_keeps_serving(released):
    src, dst = _pool(), _pool(seed=3)
    sender = _sender(src, released)
    try:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        secure(zmq.Context.instance(), sock, sender.endpoint, bind=False, service="executor")  # a peer with the stack's keys
        sock.connect(sender.endpoint)
        sock.send_multipart([b"PULL", b"\xc1not msgpack"])
        assert sock.poll(2000)
        assert sock.recv_multipart()[0] == b"ERR"
        sock.close(0)
        handle = sender.export([3])
        KVReceiver(dst, KVLayout.of(dst)).pull(handle, [4])
        assert torch.equal(src.kv_caches[0][0][3], dst.kv_caches[0][0][4])
    finally:
        sender.close()


def test_a_transfer_is_served_to_one_peer_only(released):
    src = _pool()
    sender = _sender(src, released)
    ctx = zmq.Context.instance()
    socks = []
    try:
        handle = sender.export([3])
        layout = KVLayout.of(src).to_wire()
        for _ in range(2):
            sock = ctx.socket(zmq.DEALER)
            sock.linger = 0
            secure(ctx, sock, sender.endpoint, bind=False, service="executor")
            sock.connect(sender.endpoint)
            socks.append(sock)
        first, second = socks
        first.send_multipart([b"PULL", msgspec.msgpack.encode({"transfer_id": handle.transfer_id, "layout": layout})])
        assert first.poll(2000) and first.recv_multipart()[0] == b"OK"
        second.send_multipart([b"PULL", msgspec.msgpack.encode({"transfer_id": handle.transfer_id, "layout": layout})])
        assert second.poll(2000)
        status, reply = second.recv_multipart()[:2]
        assert status == b"ERR" and msgspec.msgpack.decode(reply)["kind"] == "taken"
        second.send_multipart([b"FAIL", msgspec.msgpack.encode({"transfer_id": handle.transfer_id})])
        assert second.poll(2000) and second.recv_multipart()[0] == b"OK"
        assert handle.transfer_id in sender.outstanding  # another peer's FAIL freed nothing
        first.send_multipart([b"CONFIRM", msgspec.msgpack.encode({"transfer_id": handle.transfer_id})])
        assert first.poll(2000) and first.recv_multipart()[0] == b"OK"
        assert handle.transfer_id not in sender.outstanding and sender.counts["confirmed"] == 1
    finally:
        for sock in socks:
            sock.close(0)
        sender.close()


def test_blocks_the_receiver_holds_already_are_skipped(released):
    """-1 in the receiving ids: a block its prefix cache holds; the frame's bytes are not written."""
    src, dst = _pool(seed=1), _pool(seed=2)
    before = [t.clone() for kv in dst.kv_caches for t in kv]
    sender = _sender(src, released)
    try:
        handle = sender.export([2, 3, 4, 6])
        moved = KVReceiver(dst, KVLayout.of(dst)).pull(handle, [-1, -1, 5, 0])
        assert moved == 2 * src.shape.bytes_per_block
        for (sk, sv), (dk, dv), i in zip(src.kv_caches, dst.kv_caches, range(3)):
            assert torch.equal(sk[4], dk[5]) and torch.equal(sv[6], dv[0])
            assert torch.equal(dk[1], before[2 * i][1]) and torch.equal(dk[2], before[2 * i][2])
        assert released[0][2] is True
    finally:
        sender.close()


def test_a_transfer_staged_for_one_key_is_served_to_that_key_only(stack_keys_dir, released):
    """Two decode instances' keys, both let in by the stack: the transfer named for one of them
    gives the other nothing (not even that it exists), then gives the named one its blocks, once."""
    from folio.shared import curve
    from folio.shared.keys import init_peer, load_keys

    a, b = init_peer(stack_keys_dir, "decode-a"), init_peer(stack_keys_dir, "decode-b")
    keys_a, keys_b = load_keys(stack_keys_dir, peer="decode-a"), load_keys(stack_keys_dir, peer="decode-b")
    assert {a, b} <= keys_a.allowed and keys_a.client_public == a and keys_b.client_public == b
    curve.use_keys(stack_keys_dir)  # the folder read again: its ZAP handler lets both peers in
    src, dst = _pool(seed=1), _pool(seed=2)
    ctx = zmq.Context()  # a context of its own: a fresh ZAP handler
    sender = _sender(src, released, ctx=ctx)
    try:
        handle = sender.export([3, 4], num_tokens=8, peer=a)
        refused_before = curve.REFUSALS.num_refused
        with pytest.raises(TransferError, match="not outstanding"):
            KVReceiver(dst, KVLayout.of(dst), keys=keys_b).pull(handle, [0, 1])
        with pytest.raises(TransferError, match="not outstanding"):  # nor the stack's shared client key
            KVReceiver(dst, KVLayout.of(dst)).pull(handle, [0, 1])
        assert not torch.equal(dst.kv_caches[0][0][0], src.kv_caches[0][0][3])  # nothing landed
        assert sender.counts["refused"] == 2 and curve.REFUSALS.num_refused == refused_before + 2
        assert handle.transfer_id in sender.outstanding and not released  # the strangers' FAILs freed nothing
        moved = KVReceiver(dst, KVLayout.of(dst), keys=keys_a).pull(handle, [0, 1])
        assert moved == 2 * src.shape.bytes_per_block
        for (sk, sv), (dk, dv) in zip(src.kv_caches, dst.kv_caches):
            assert torch.equal(sk[3].view(torch.uint8), dk[0].view(torch.uint8))
            assert torch.equal(sv[4].view(torch.uint8), dv[1].view(torch.uint8))
        assert released == [(handle.transfer_id, [3, 4], True)]
        with pytest.raises(TransferError, match="not outstanding"):  # once
            KVReceiver(dst, KVLayout.of(dst), keys=keys_a).pull(handle, [0, 1])
    finally:
        sender.close()
        curve.release(ctx)
        ctx.term()


def test_the_transfer_benchmark_ends_with_its_own_contexts_under_curve(stack_keys_dir):
    """``folio bench disagg --skip-serving`` makes a context per end, as two processes have: it
    must close its sockets and stop each context's key handler, or the context's end waits forever."""
    import json
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "folio.bench.disagg", "--skip-serving", "--blocks", "8", "--reps", "1"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "FOLIO_KEYS_DIR": stack_keys_dir})
    assert out.returncode == 0, out.stderr[-2000:]
    figures = json.loads(out.stdout.splitlines()[0])  # its first line: the figures as one JSON object
    assert figures["tcp_loopback"]["bytes"] > 0
