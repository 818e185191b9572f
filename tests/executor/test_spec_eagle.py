"""The eagle3 draft head: lossless greedy output through the scheduler and the runner (batches,
prefix caching), the head's cache following the accepted tokens, and the refusals."""

from __future__ import annotations

import json

import pytest
import torch

from folio.core.executor.runtime.spec_eagle import (CARD_FILE, EagleHead, HeadConfig, load_head, save_head,
                                                    target_fingerprint)
from tests.core.engine import engine_request
from tests.executor.test_spec_decode import make_runner, repetitive_prompts, run


def write_random_head(target_dir: str, folder, seed: int = 0) -> str:
    """A head with random weights for ``target_dir``'s model, its card naming that model."""
    from folio.core.executor.model.loader import load_model

    target = load_model(target_dir, torch.float32, torch.device("cpu"))
    torch.manual_seed(seed)
    head = EagleHead(HeadConfig.for_target(target.spec, draft_vocab_size=48))
    head.draft_to_target.copy_(torch.randperm(target.spec.vocab_size)[:48])
    save_head(head, folder, {"target": {"fingerprint": target_fingerprint(target), "model": target_dir}})
    return str(folder)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from folio.testing.models import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("eagle-target"), vocab_size=64, num_hidden_layers=4)


@pytest.fixture(scope="module")
def random_head(tiny_target, tmp_path_factory):
    return write_random_head(tiny_target, tmp_path_factory.mktemp("eagle-head"))


def eagle(head: str, k: int = 3) -> dict:
    return {"speculative_config": json.dumps({"method": "eagle3", "model": head, "num_speculative_tokens": k,
                                              "adaptive": False})}


@pytest.mark.parametrize("caching", [False, True], ids=["plain", "prefix-caching"])
def test_greedy_output_with_an_eagle_head_is_plain_decoding(tiny_target, random_head, caching):
    """Eight requests at once, two waves sharing prompts (the second hits the prefix cache)."""
    prompts = repetitive_prompts(8, seed=4)
    reqs = [engine_request(f"r{i}", p, 20, ignore_eos=True) for i, p in enumerate(prompts + prompts[:3])]
    _, plain = run(make_runner(tiny_target), reqs, enable_prefix_caching=caching)
    runner = make_runner(tiny_target, **eagle(random_head))
    engine, fast = run(runner, reqs, enable_prefix_caching=caching)
    assert fast == plain
    c = engine.sched.counters
    assert c["num_spec_drafts"] > 0 and c["num_spec_draft_tokens"] >= c["num_spec_accepted_tokens"]
    assert runner.proposer.num_proposals > 0 and not runner.proposer.seqs  # every request's cache dropped
    assert engine.alloc.num_used_blocks == 0


def test_the_heads_cache_keeps_only_what_the_target_verified(tiny_target, random_head):
    """After a partial acceptance the head's next drafts equal a fresh head's, fed the same
    tokens and hidden states from the start: no rejected draft's feature or key survives."""
    import numpy as np

    from folio.core.executor.runtime.spec_eagle import EagleProposer
    from tests.core.engine import LocalEngine

    runner = make_runner(tiny_target, **eagle(random_head, k=4))
    seen: list[tuple[list[int], list[int]]] = []  # (tokens, drafts) of every proposal along the way
    original = runner.proposer.propose

    def spy(states):
        out = original(states)
        seen.extend((s.token_ids, p.token_ids) for s, p in zip(states, out))
        return out

    runner.proposer.propose = spy
    engine = LocalEngine(runner)
    engine.add(engine_request("a", repetitive_prompts(1, seed=2)[0], 24, ignore_eos=True))
    engine.run()
    c = engine.sched.counters
    assert len(seen) > 3 and c["num_spec_accepted_tokens"] < c["num_spec_draft_tokens"]  # rejections happened
    head = runner.proposer.head
    for tokens, drafts in seen:
        fresh = EagleProposer(head, runner.model, 4, torch.device("cpu"))
        hidden = _teacher_forced(runner, tokens[:-1])
        fresh.observe(["x"], np.array([0]), np.array([len(tokens) - 1]), hidden)

        class State:
            req_id, token_ids = "x", tokens

        assert fresh.propose([State()])[0].token_ids == drafts


def _teacher_forced(runner, tokens: list[int]) -> torch.Tensor:
    """The target's hidden states over ``tokens`` in one prefill (taps set in ``model.tapped``)."""
    from folio.core.executor.kernels.attention import AttentionMetadata
    from folio.core.kv.tensors.pool import KVPool

    bs = runner.pool.block_size
    pool = KVPool(runner.pool_shape, -(-len(tokens) // bs), torch.device("cpu"))
    meta = AttentionMetadata.build([len(tokens)], [len(tokens)], [list(range(pool.num_blocks))], None, bs,
                                   torch.device("cpu"))
    with torch.inference_mode():
        return runner.model(torch.tensor(tokens), meta.positions, pool.kv_caches, meta, runner.backend)


def test_a_head_for_another_model_is_refused_at_start(tiny_target, tmp_path):
    from folio.testing.models import write_tiny_model

    other = write_tiny_model(tmp_path / "other", vocab_size=64, num_hidden_layers=4, hidden_size=32)
    head = write_random_head(other, tmp_path / "head")
    with pytest.raises(ValueError, match="trained for another model"):
        make_runner(tiny_target, **eagle(head))
    with pytest.raises(ValueError, match="no eagle3 draft head ships for the served model"):
        make_runner(tiny_target, speculative_config='{"method": "eagle3"}')
    from folio.core.executor.parallel.comm import Shard
    from folio.core.executor.runtime.runner import ModelRunner
    from folio.shared.config import RuntimeConfig

    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        ModelRunner(RuntimeConfig(device="cpu", **eagle(head)), tiny_target, shard=Shard(0, 2))
    card = json.loads((tmp_path / "head" / CARD_FILE).read_text())
    assert card["format"] == "folio-eagle3-v1" and card["config"]["draft_vocab_size"] == 48


def test_the_head_round_trips_through_its_file(tiny_target, random_head):
    from folio.core.executor.model.loader import load_model

    target = load_model(tiny_target, torch.float32, torch.device("cpu"))
    a = load_head(random_head, target, torch.float32, torch.device("cpu"))
    save_head(a, random_head + "-copy", json.loads(open(f"{random_head}/{CARD_FILE}").read()))
    b = load_head(random_head + "-copy", target, torch.float32, torch.device("cpu"))
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name


def test_the_kernel_stack_hands_out_the_hidden_states_the_modules_do(tiny_target, random_head):
    """A decode step through csrc/stack.c (the default int4 path) taps the same residuals, bit for
    bit, as the modules one by one; and greedy output with the head stays plain decoding's there."""
    from folio.core.executor.kernels.attention import AttentionMetadata

    runner = make_runner(tiny_target, quantization="int4", attention_backend="cpu", **eagle(random_head))
    stack = runner.backend.stack
    meta = AttentionMetadata.build([1, 1], [5, 3], [[0, 1], [2]], None, 4, torch.device("cpu"))
    ids = torch.tensor([7, 9])
    with torch.inference_mode():
        out = runner.model(ids, meta.positions, runner.pool.kv_caches, meta, runner.backend)
        tapped = runner.model.tapped
        assert stack.num_calls == 1
        runner.backend.stack = None
        again = runner.model(ids, meta.positions, runner.pool.kv_caches, meta, runner.backend)
    assert torch.equal(out, again)
    assert len(tapped) == 2 and all(torch.equal(a, b) for a, b in zip(tapped, runner.model.tapped))
    runner.backend.stack = stack
    reqs = [engine_request(f"r{i}", p, 16, ignore_eos=True) for i, p in enumerate(repetitive_prompts(4, seed=6))]
    _, plain = run(make_runner(tiny_target, quantization="int4", attention_backend="cpu"), reqs)
    _, fast = run(runner, reqs)
    assert fast == plain and stack.num_calls > 10


def test_eagle_is_lossless_with_preemption_choices_and_steps_without_drafts(tiny_target, random_head):
    """n = 2 choices in a pool small enough to preempt, the controller drafting every other step
    (the head then catches up on several positions at once), async scheduling between."""
    from tests.executor.test_spec_suffix import Alternating

    reqs = [engine_request(f"r{i}", p, 24, ignore_eos=True, fork_req_ids=[f"r{i}-1"])
            for i, p in enumerate(repetitive_prompts(6, seed=21))]
    _, plain = run(make_runner(tiny_target, num_kv_blocks=40), reqs)
    runner = make_runner(tiny_target, num_kv_blocks=40, **eagle(random_head))
    runner.spec_control = Alternating()
    engine, fast = run(runner, reqs, async_scheduling=True)
    assert fast == plain
    c = engine.sched.counters
    assert c["num_preemptions"] > 0 and c["num_spec_drafts"] > 0
    assert engine.alloc.num_used_blocks == 0 and not runner.proposer.seqs


def test_training_unrolls_the_chain_the_proposer_drafts(tiny_target, random_head):
    """``EagleHead.unrolled`` (what train-draft optimises) at the chain that starts after the
    target's last feature gives the proposer's drafts: training and serving see one computation."""
    import numpy as np

    from folio.core.executor.runtime.spec_eagle import EagleProposer

    runner = make_runner(tiny_target, **eagle(random_head, k=4))
    head = runner.proposer.head
    tokens = repetitive_prompts(1, seed=13)[0][:20]
    hidden = _teacher_forced(runner, tokens[:-1])
    feats = torch.cat([*runner.model.tapped, hidden.float()], dim=-1)
    proposer = EagleProposer(head, runner.model, 4, torch.device("cpu"))
    proposer.observe(["x"], np.array([0]), np.array([len(tokens) - 1]), hidden)

    class State:
        req_id, token_ids = "x", tokens

    drafts = proposer.propose([State()])[0].token_ids
    last = len(tokens) - 2
    chain = torch.tensor(tokens + drafts)
    padded = torch.cat([feats, torch.zeros(len(drafts), feats.shape[1])])  # positions past ``last``: unread
    with torch.no_grad():
        logits = head.unrolled(padded[None], chain[1:][None], 4)
    unrolled = [int(head.draft_to_target[logits[d][0, last + d].argmax()]) for d in range(4)]
    assert unrolled == drafts


def test_a_cpu_proposer_runs_its_head_in_the_int8_kernels(tiny_target, random_head):
    """On the CPU the proposer packs the head's linear maps and LM rows as per-channel int8 for
    folio's kernels (a draft token reads a quarter of the fp32 bytes); the drafts' logits stay
    the fp32 head's within int8 rounding, once packed the head is left as it is."""
    from folio.core.executor.model.loader import load_model
    from folio.core.executor.runtime.spec_eagle import EagleProposer, Int8Linear

    target = load_model(tiny_target, torch.float32, torch.device("cpu"))
    dense = load_head(random_head, target, torch.float32, torch.device("cpu"))
    packed = load_head(random_head, target, torch.float32, torch.device("cpu"))
    EagleProposer(packed, target, 3, torch.device("cpu"))
    assert all(isinstance(getattr(packed, n), Int8Linear) for n in ("fc", "qkv_proj", "o_proj", "gate_up_proj",
                                                                    "down_proj"))
    assert isinstance(packed.target["lm"], Int8Linear) and not isinstance(dense.fc, Int8Linear)
    fc = packed.fc
    EagleProposer(packed, target, 3, torch.device("cpu"))  # a second proposer over the same head
    assert packed.fc is fc
    torch.manual_seed(0)
    h = packed.cfg.hidden_size
    feats, attn = torch.randn(2, 5, 3 * h), torch.randn(2, 5, packed.cfg.num_heads, packed.cfg.head_dim)
    with torch.inference_mode():
        want = dense.logits(dense.finish(dense.fuse(feats), attn))
        got = packed.logits(packed.finish(packed.fuse(feats), attn))
    assert got.shape == want.shape == (2, 5, packed.cfg.draft_vocab_size)
    assert ((got - want).abs().max() / want.abs().max()).item() < 0.05
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.8
