"""Tree drafts: the shape (``DraftTree``), attention over a tree's paths on the torch and C paths
against a dense oracle, the C boundary's checks of a tree row, the tree verifier (greedy walk and
sampling without replacement, chi-square against p), and the runner end to end: greedy output
equal to plain decoding, the accepted path's KV moved where the next steps read it."""

from __future__ import annotations

import ctypes
import json
import random

import numpy as np
import pytest
import torch

from folio.core.executor.kernels import cpu_kernels
from folio.core.executor.kernels.attention import AttentionMetadata, TorchAttentionBackend, move_slots
from folio.core.executor.kernels.cpu_backend import CpuKernelBackend, kv_struct
from folio.core.executor.runtime.spec_config import default_tree, parse_speculative_config
from folio.core.executor.runtime.spec_decode import DraftTree, Proposal
from folio.core.executor.sampling.rejection import verify_tree
from folio.core.executor.sampling.sampler import SamplingRow
from folio.shared.sampling import SamplingParams
from tests.core.engine import engine_request
from tests.executor.test_spec_decode import make_runner, repetitive_prompts, run
from tests.executor.test_spec_eagle import random_head, tiny_target  # noqa: F401 (fixtures)

TREE = DraftTree.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]])  # 3, 2, 1 wide


def test_a_tree_from_paths_has_its_parents_depths_masks_and_prefixes():
    assert TREE.parents == (-1, -1, -1, 0, 0, 1, 3, 6)
    assert TREE.depths().tolist() == [0, 1, 1, 1, 2, 2, 2, 3, 4]
    masks = TREE.masks()
    assert [bin(int(m)) for m in masks[:5]] == ["0b1", "0b11", "0b101", "0b1001", "0b10011"]
    assert int(masks[8]) == 0b110010011  # root, node 1, 4, 7, 8: the best path
    assert TREE.children() == [[1, 2, 3], [4, 5], [6], [], [7], [], [], [8], []]
    # a prefix of the nodes is a tree: what a step that verifies fewer drafts keeps
    assert TREE.children(4) == [[1, 2, 3], [4], [], [], []] and TREE.masks(4).tolist() == masks[:5].tolist()
    chain = DraftTree.from_paths([[0], [0, 0], [0, 0, 0]])
    assert chain.parents == (-1, 0, 1) and chain.depths().tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="lack their parent"):
        DraftTree.from_paths([[0], [1, 0]])
    with pytest.raises(ValueError, match="before its node"):
        DraftTree((0,))


def test_the_config_takes_a_tree_for_eagle3_and_says_what_is_wrong():
    cfg = parse_speculative_config({"method": "eagle3", "num_speculative_tokens": 4, "tree": True})
    assert cfg.tree == default_tree(4) and DraftTree.from_paths(cfg.tree).parents == (-1, -1, 0, 2)
    given = parse_speculative_config('{"method": "eagle3", "tree": [[0], [1], [0, 0]]}')
    assert DraftTree.from_paths(given.tree).parents == (-1, -1, 0)
    for bad, why in (({"method": "ngram", "tree": True}, "for the eagle3 method"),
                     ({"method": "eagle3", "tree": [[0], [1, 1]]}, "lack their parent"),
                     ({"method": "eagle3", "tree": [[0], [-1]]}, "child ranks >= 0"),
                     ({"method": "eagle3", "tree": "wide"}, "true or a list of paths"),
                     ({"method": "eagle3", "tree": [[i] for i in range(16)]}, "at most 15")):
        with pytest.raises(ValueError, match=why):
            parse_speculative_config(bad)


# ---------------------------------------------------------------------- attention over a tree
def _pool(num_blocks=12, block_size=4, kv_heads=2, head_dim=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _tree_meta(context: int, tree: DraftTree, table: list[int], block_size: int, other: int | None = None):
    """A step of one tree sequence (root at position ``context``), and optionally a plain decode
    sequence of ``other`` keys beside it, over block table ``table`` (both read it)."""
    n = len(tree.parents) + 1
    lens = [n] + ([1] if other else [])
    seq_lens = [context + n] + ([other] if other else [])
    meta = AttentionMetadata.build(lens, seq_lens, [table] * len(lens), None, block_size)
    meta.trees = {0: tree.masks()}
    return meta


def _oracle(q, k_cache, v_cache, table, block_size, context, mask: int, scale):
    """Dense attention of one row over its context's keys and the tree positions in ``mask``."""
    positions = list(range(context)) + [context + j for j in range(64) if mask >> j & 1]
    slots = [table[p // block_size] * block_size + p % block_size for p in positions]
    k = k_cache.view(-1, *k_cache.shape[2:])[slots].float()  # [keys, kv_heads, hd]
    v = v_cache.view(-1, *v_cache.shape[2:])[slots].float()
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("hd,khd->hk", q.float(), k) * scale
    return torch.einsum("hk,khd->hd", s.softmax(-1), v)


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
def test_tree_rows_attend_their_context_and_their_own_path(backend_name):
    block_size, heads, scale = 4, 6, 0.125
    k_cache, v_cache = _pool(block_size=block_size)
    table = random.Random(1).sample(range(12), 12)
    context = 13  # the root at position 13: the tree spans blocks 3-5
    meta = _tree_meta(context, TREE, table, block_size, other=22)
    q = torch.randn(meta.slot_mapping.shape[0], heads, 64)
    backend = TorchAttentionBackend() if backend_name == "torch" else CpuKernelBackend(
        cpu_kernels.library(), torch.bfloat16, final_norm=None)
    out = backend.attend(q, k_cache, v_cache, meta, scale)
    for i, mask in enumerate(TREE.masks().tolist()):
        torch.testing.assert_close(out[i], _oracle(q[i], k_cache, v_cache, table, block_size, context, mask, scale),
                                   rtol=1e-5, atol=1e-5)
    # the decode row beside it is causal as ever
    torch.testing.assert_close(out[-1], _oracle(q[-1], k_cache, v_cache, table, block_size, 21, 1, scale),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
def test_a_chain_given_as_a_tree_attends_bit_for_bit_as_the_chain(backend_name):
    """The same keys in the same order: a verified chain's bits do not depend on the form."""
    block_size = 4
    k_cache, v_cache = _pool(block_size=block_size, seed=3)
    table = list(range(12))
    chain = DraftTree((-1, 0, 1, 2))
    as_tree = _tree_meta(9, chain, table, block_size)
    causal = AttentionMetadata.build([5], [14], [table], None, block_size)
    q = torch.randn(5, 4, 64)
    make = (lambda: TorchAttentionBackend()) if backend_name == "torch" else (
        lambda: CpuKernelBackend(cpu_kernels.library(), torch.bfloat16, final_norm=None))
    assert torch.equal(make().attend(q, k_cache, v_cache, as_tree, 0.1), make().attend(q, k_cache, v_cache, causal, 0.1))


def test_the_c_kernel_refuses_a_tree_row_that_reads_past_its_table_or_a_window():
    lib = cpu_kernels.library()
    k_cache, v_cache = _pool(num_blocks=4, block_size=4)
    tok, seq, lens = (np.array([0], dtype=np.int64) for _ in range(3))
    lens[0] = 13
    table = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)
    q, out = torch.randn(1, 2, 64), torch.empty(1, 2, 64)
    scratch = np.empty(4096, dtype=np.float32)

    def call(extra: int, window: int = 0) -> int:
        mask = np.array([extra], dtype=np.uint64)
        rows = cpu_kernels.Rows(m=1, tok=tok.ctypes.data, seq=seq.ctypes.data, lens=lens.ctypes.data,
                                block_tables=table.data_ptr(), num_seqs=1, max_blocks=4, extra=mask.ctypes.data)
        return lib.folio_decode_attention(ctypes.byref(rows), q.data_ptr(), 1, 2, kv_struct(k_cache, v_cache), 0.1,
                                          window, 0.0, out.data_ptr(), scratch.ctypes.data, 1024, 1)

    assert call(0b111) == 0  # positions 13, 14, 15: the table's last block
    assert call(0b1001) < 0 and b"keys up to 17" in lib.folio_last_error()  # position 16: past the table
    assert call(1 << 63) < 0  # far past it
    assert call(0b1, window=8) < 0 and b"sliding-window" in lib.folio_last_error()


def test_moving_slots_copies_every_layers_k_and_v():
    caches = [_pool(num_blocks=3, block_size=4, seed=s) for s in range(2)]
    before = [(k.clone(), v.clone()) for k, v in caches]
    move_slots(caches, [9, 7], [5, 6])  # slot 6 takes slot 7 before slot 7 is anything else
    for (k, v), (k0, v0) in zip(caches, before):
        for c, c0 in ((k, k0), (v, v0)):
            flat, flat0 = c.view(12, 2, 64), c0.view(12, 2, 64)
            assert torch.equal(flat[5], flat0[9]) and torch.equal(flat[6], flat0[7])
            assert torch.equal(flat[[0, 1, 2, 3, 4, 7, 8, 9, 10, 11]], flat0[[0, 1, 2, 3, 4, 7, 8, 9, 10, 11]])


# ---------------------------------------------------------------------- the verifier
def _row(temperature: float, seed: int | None = None, output=()) -> SamplingRow:
    return SamplingRow(SamplingParams(temperature=temperature, seed=seed), None, [1, 2], list(output), seed=seed)


def test_a_greedy_walk_follows_the_targets_argmax_through_the_tree():
    vocab = 16
    tokens = [5, 7, 9, 3, 4, 11, 2, 8]  # TREE's nodes, breadth-first
    logits = torch.zeros(9, vocab)
    logits[0, 7] = 5  # root -> node 2 (token 7, rank 1)
    logits[2, 11] = 5  # node 2 -> node 6 (token 11)
    logits[6, 13] = 5  # node 6 is a leaf: 13 is the bonus
    out, path = verify_tree(logits, TREE.children(), tokens, _row(0.0))
    assert (out, path) == ([7, 11, 13], [2, 6])
    logits[0, 7], logits[0, 10] = 0, 5  # no child is the argmax: the argmax alone
    assert verify_tree(logits, TREE.children(), tokens, _row(0.0)) == ([10], [])
    with pytest.raises(ValueError, match="penalties"):
        verify_tree(logits, TREE.children(), tokens, SamplingRow(SamplingParams(presence_penalty=0.5), None, [1], []))


def test_sampled_tree_verification_outputs_exactly_the_targets_distribution():
    """First token over 3,000 seeds against p (chi-square, 1e-4 level): children at the top of
    p, in the middle and one that p rules out; the second token given the first as well."""
    from scipy.stats import chisquare

    vocab = 6
    p0 = torch.tensor([0.30, 0.05, 0.25, 0.0, 0.15, 0.25])
    tree = DraftTree.from_paths([[0], [1], [2], [0, 0]])
    tokens = [0, 3, 5, 2]  # children of the root: 0 (p .30), 3 (p 0), 5 (.25); 0's child: 2
    p1 = torch.tensor([0.1, 0.1, 0.5, 0.1, 0.1, 0.1])
    logits = torch.stack([p0.clamp_min(1e-30).log(), p1.log(), p0.log(), p0.log(), p0.log()])
    logits[0, 3] = float("-inf")
    first, second = np.zeros(vocab), np.zeros(vocab)
    for seed in range(3000):
        out, path = verify_tree(logits, tree.children(), tokens, _row(1.0, seed=seed))
        first[out[0]] += 1
        if out[0] == 0:
            assert path[0] == 1 and len(out) == len(path) + 1 and (len(path) == 2) == (out[1] == 2)
            second[out[1]] += 1
    assert first[3] == 0
    keep = (p0 > 0).numpy()
    want0, want1 = p0.double().numpy()[keep], p1.double().numpy()
    assert chisquare(first[keep], want0 / want0.sum() * first.sum()).pvalue > 1e-4
    assert chisquare(second, want1 / want1.sum() * second.sum()).pvalue > 1e-4


# ---------------------------------------------------------------------- the runner end to end
class OracleTreeProposer:
    """Proposes ``TREE``'s shape with the target's greedy continuation (from a plain run) at rank
    ``rank`` among each position's children and other tokens beside it, so that every accepted
    path but rank 0's sits off the slots of its positions and must be moved."""

    def __init__(self, continuations: dict[str, list[int]], prompts: dict[str, int], vocab: int, rank: int):
        self.cont, self.prompts, self.vocab, self.rank = continuations, prompts, vocab, rank
        self.num_trees = 0

    def propose(self, states):
        return [Proposal([]) for _ in states]

    def propose_tree(self, states, tree):
        out = []
        for s in states:
            done = len(s.token_ids) - self.prompts[s.req_id]
            truth = self.cont[s.req_id][done:]
            tokens, on_path = [], {0: True}
            for node, c in enumerate(tree.children()):
                for rank, child in enumerate(c):
                    depth = int(tree.depths()[child]) - 1
                    right = on_path.get(node, False) and rank == min(self.rank, len(c) - 1) and depth < len(truth)
                    want = truth[depth] if depth < len(truth) else 0
                    tokens.append((child, want if right else (want + 1 + rank) % self.vocab))
                    on_path[child] = right
            out.append(Proposal([t for _, t in sorted(tokens)], tree=tree))
            self.num_trees += 1
        return out

    def rollback(self, req_id, num_valid):
        pass

    def drop(self, req_id, token_ids=None, adapter=0):
        pass


PATHS = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]


def _tree_config(head: str, adaptive: bool = False, tree=PATHS) -> dict:
    return {"speculative_config": json.dumps({"method": "eagle3", "model": head, "num_speculative_tokens": 4,
                                              "adaptive": adaptive, "tree": tree})}


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("attention", ["torch", "cpu"])
def test_greedy_output_with_tree_drafts_is_plain_decoding_and_the_kv_follows_the_path(tiny_target, random_head, rank,
                                                                                      attention):
    prompts = repetitive_prompts(4, seed=7)
    reqs = [engine_request(f"r{i}", p, 24, ignore_eos=True) for i, p in enumerate(prompts)]
    _, plain = run(make_runner(tiny_target, attention_backend=attention), reqs)
    runner = make_runner(tiny_target, attention_backend=attention, **_tree_config(random_head))
    assert runner.tree is not None and runner.tree.parents == TREE.parents
    runner.proposer = OracleTreeProposer(plain, {r.req_id: len(r.prompt_token_ids) for r in reqs}, 64, rank)
    engine, fast = run(runner, reqs)
    assert fast == plain
    c = engine.sched.counters
    # rank 0: the best path, 4 deep, in the slots of its positions; rank 1: 2 deep, both moved
    per_step = 2.5 if rank == 0 else 1.5  # (less at the end of each request)
    assert runner.proposer.num_trees > 0 and c["num_spec_accepted_tokens"] >= per_step * c["num_spec_drafts"]
    assert engine.alloc.num_used_blocks == 0


def test_eagle_tree_drafts_are_lossless_and_the_controller_measures_both_shapes(tiny_target, random_head):
    prompts = repetitive_prompts(6, seed=11)
    reqs = [engine_request(f"r{i}", p, 20, ignore_eos=True) for i, p in enumerate(prompts)]
    _, plain = run(make_runner(tiny_target), reqs, enable_prefix_caching=True)
    runner = make_runner(tiny_target, **_tree_config(random_head, adaptive=True, tree=True))
    engine, fast = run(runner, reqs, enable_prefix_caching=True)
    assert fast == plain
    assert runner.proposer.num_proposals > 0 and not runner.proposer.seqs
    stats = runner.stats()
    assert stats["spec_steps_chain"] + stats["spec_steps_tree"] == sum(runner.tree_control.num_steps) > 0
    assert engine.alloc.num_used_blocks == 0


def test_tree_drafts_are_refused_where_they_cannot_be_verified(tmp_path, random_head, tiny_target):
    from folio.testing.models import write_tiny_model

    windowed = write_tiny_model(tmp_path / "windowed", "mistral", vocab_size=64, num_hidden_layers=2, sliding_window=8)
    with pytest.raises(ValueError, match="sliding-window"):
        make_runner(windowed, speculative_config=json.dumps({"method": "eagle3", "tree": True,
                                                              "model": random_head}))
