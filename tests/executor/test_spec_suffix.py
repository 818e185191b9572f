"""Suffix speculation (a trie over earlier requests), the per-step choice to speculate, and
``--speculative-config``: the trie's counts and bounds, drafts whose length follows the match,
lossless greedy output through ``LocalEngine`` with prefix caching, preemption and n > 1."""

from __future__ import annotations

import pytest

from folio.core.executor.runtime.spec_control import SpecController
from folio.core.executor.runtime.spec_suffix import SuffixProposer, SuffixTrie
from folio.shared.config import RuntimeConfig
from folio.core.executor.runtime.spec_config import LORA_REFUSAL, speculative_refusal, speculative_settings
from tests.core.engine import engine_request
from tests.executor.test_spec_decode import make_runner, repetitive_prompts, run


# --------------------------------------------------------------------------- the trie


def test_trie_counts_substrings_and_forgets_them_exactly():
    trie = SuffixTrie(max_depth=4)
    trie.add([1, 2, 3, 1, 2, 4])
    assert trie._find([1, 2]).count == 2 and trie._find([2, 3]).count == 1
    assert trie._find([1, 2, 3, 1, 2]) is None  # deeper than max_depth is not kept
    assert trie.longest_match([9, 3, 1, 2]) == (3, trie._find([3, 1, 2]))
    assert trie.longest_match([7, 8])[0] == 0
    nodes = trie.num_nodes
    trie.add([5, 1, 2])
    trie.remove([5, 1, 2])
    assert trie.num_nodes == nodes  # a removal gives back exactly what the add made
    trie.remove([1, 2, 3, 1, 2, 4])
    assert trie.num_nodes == 0 and not trie.root.children


def test_draft_length_follows_the_match_and_its_frequency():
    trie = SuffixTrie(max_depth=16)
    for _ in range(3):
        trie.add([10, 11, 12, 13, 14, 15, 16])
    trie.add([10, 11, 12, 40, 41])
    # [11, 12] seen 4 times, followed by 13 three times out of four: taken, then 14, 15, ...
    # but a 2-token match may propose at most 2 tokens (max_spec_factor 1)
    assert trie.continuation([0, 11, 12], k=8, max_spec_factor=1.0, min_token_prob=0.1) == (2, [13, 14])
    assert trie.continuation([10, 11, 12], k=8, max_spec_factor=1.0, min_token_prob=0.1) == (3, [13, 14, 15])
    assert trie.continuation([10, 11, 12], k=8, max_spec_factor=3.0, min_token_prob=0.1)[1] == [13, 14, 15, 16]
    # a branch under min_token_prob of its parent's occurrences stops the draft
    assert trie.continuation([10, 11, 12], k=8, max_spec_factor=3.0, min_token_prob=0.8)[1] == []
    assert trie.continuation([99], k=8, max_spec_factor=3.0, min_token_prob=0.1) == (0, [])
    # a match as long as the trie is deep leaves room for k tokens after it: it is shortened
    shallow, text = SuffixTrie(max_depth=8), list(range(100, 120))
    shallow.add(text)
    assert shallow.continuation(text[:15], k=4, max_spec_factor=1.0, min_token_prob=0.1) == (4, text[15:19])


def test_the_proposer_keeps_a_bounded_set_of_requests_per_adapter():
    p = SuffixProposer(k=4, max_depth=8, max_cached_requests=2)
    p.drop("a", [1, 2, 3, 4, 5, 6])
    assert p.propose_one([9, 1, 2, 3]) == [4, 5, 6]  # from request a, though not in this one's tokens
    assert p.propose_one([9, 1, 2, 3], adapter=7) == []  # another adapter's trie is empty
    p.drop("a", [1, 2, 3, 4, 5, 6])  # seen again (preempted, then finished): replaced, not doubled
    assert p.tries[0]._find([1, 2]).count == 1
    p.drop("b", [20, 21, 22])
    p.drop("c", [30, 31, 32])  # the oldest, a, leaves
    assert list(p.cached) == ["b", "c"] and p.tries[0]._find([1]) is None
    assert p.propose_one([5, 6, 7, 5]) == [6, 7, 5]  # its own tokens: prompt lookup


# --------------------------------------------------------------------------- when to speculate


def test_the_controller_picks_the_faster_arm_and_explores_rarely():
    ctl = SpecController(explore_every=16, min_samples=2)
    decisions = []
    for _ in range(200):
        speculate = ctl.choose(1)
        decisions.append(speculate)
        ctl.proposed(1, speculate, 0.001)
        ctl.observe(0.010, 3 if speculate else 1, True)  # drafts give 3 tokens in the time of one
    assert sum(decisions[10:]) / len(decisions[10:]) > 0.9
    crowded = [ctl.choose(32) for _ in range(1)]
    ctl.proposed(32, crowded[0], 0.0)
    for _ in range(400):  # at batch 32 drafting is 2.7x slower: plain wins, and drafts are tried again
        speculate = ctl.choose(32)  # only every 16 * 2.7^2 = 113 steps
        ctl.proposed(32, speculate, 0.002)
        ctl.observe(0.030 if speculate else 0.012, 32, True)
        crowded.append(speculate)
    assert 2 <= sum(crowded[20:]) <= 4
    assert ctl.explore_interval(1.1, 1.0) == 19 and ctl.explore_interval(10.0, 1.0) == 256
    switched = []
    for _ in range(300):  # then drafts start to pay (a copy task): they are found and taken
        speculate = ctl.choose(32)
        ctl.proposed(32, speculate, 0.002)
        ctl.observe(0.008 if speculate else 0.012, 32 * (4 if speculate else 1), True)
        switched.append(speculate)
    assert sum(switched[-50:]) >= 45
    ctl.proposed(1, True, 0.0)
    ctl.observe(99.0, 1, decode_only=False)  # a prefill step says nothing about decode speed
    assert ctl.buckets[1].rate[1] > 100


def test_a_cold_bucket_tries_a_clear_loser_once_and_a_close_call_min_samples_times():
    def first_steps(spec_s: float, num: int = 30) -> list[bool]:
        ctl, out = SpecController(min_samples=3, clear_ratio=1.5), []
        for _ in range(num):
            speculate = ctl.choose(32)
            ctl.proposed(32, speculate, 0.0)
            ctl.observe(spec_s if speculate else 0.010, 32, True)
            out.append(speculate)
        return out

    clear = first_steps(0.027)  # a drafting step costs 2.7 plain ones and gains nothing
    assert clear[:2] == [True, False] and sum(clear) == 1
    close = first_steps(0.012)  # 1.2x: worth a few more tries before settling
    assert close[:6] == [True, False] * 3 and sum(close[:20]) == 3


# --------------------------------------------------------------------------- --speculative-config


def test_speculative_config_and_its_aliases_say_what_is_wrong():
    s = speculative_settings(RuntimeConfig(speculative_config='{"method": "suffix", "num_speculative_tokens": 6}'))
    assert (s.method, s.num_speculative_tokens, s.adaptive) == ("suffix", 6, True)
    legacy = speculative_settings(RuntimeConfig(speculative_model="ngram", num_speculative_tokens=3))
    assert (legacy.method, legacy.num_speculative_tokens, legacy.adaptive) == ("ngram", 3, False)
    assert speculative_settings(RuntimeConfig(speculative_model="/d", num_speculative_tokens=2)).model == "/d"
    for text, said in [("{", "not JSON"), ('{"method": "eagle3", "model": "/nowhere"}', "not an eagle3 draft head"),
                       ('{"method": "ngram", "k": 3}', "unknown speculative-config key(s) k"),
                       ('{"method": "draft_model"}', "needs \"model\""),
                       ('{"method": "ngram", "num_speculative_tokens": "4"}', "must be an integer")]:
        assert said in speculative_refusal(RuntimeConfig(speculative_config=text))
    both = RuntimeConfig(speculative_config='{"method": "ngram"}', speculative_model="ngram")
    assert "not both" in speculative_refusal(both)
    from folio.llm import engine_configs  # LLM takes vLLM's dict

    runtime, _ = engine_configs("m", {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}})
    assert speculative_settings(runtime).num_speculative_tokens == 2


def test_the_older_flags_given_to_folio_serve_take_the_proposers_defaults():
    """``folio serve``'s namespace holds None for a flag not given (it forwards only what was
    given); the settings are the same as a service's, whose config holds the flags' defaults."""
    import argparse

    from folio.services.serve import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--speculative-model", "ngram", "--num-speculative-tokens", "4"])
    assert speculative_refusal(args) is None
    launcher = speculative_settings(args)
    assert speculative_settings(RuntimeConfig(speculative_model="ngram", num_speculative_tokens=4)) == launcher
    assert (launcher.prompt_lookup_min, launcher.prompt_lookup_max, launcher.disable_by_batch_size) == (1, 4, 0)
    given = speculative_settings(parser.parse_args(["--speculative-model", "suffix", "--num-speculative-tokens", "2",
                                                    "--ngram-prompt-lookup-min", "2",
                                                    "--speculative-disable-by-batch-size", "8"]))
    assert (given.method, given.prompt_lookup_min, given.prompt_lookup_max, given.disable_by_batch_size) == \
        ("suffix", 2, 4, 8)
    assert "needs --num-speculative-tokens" in speculative_refusal(parser.parse_args(["--speculative-model", "ngram"]))
    # the scheduler gets --speculative-model alone (the other older flags are the executor's): it
    # only asks whether steps carry drafts (it raised there, and the service hung at start)
    from folio.services.scheduler.main import parse_config as scheduler_config
    from folio.core.executor.runtime.spec_config import speculation_on
    from folio.services.serve import service_argv

    assert speculation_on(scheduler_config(service_argv("scheduler", args, "/m")))
    assert not speculation_on(scheduler_config(service_argv("scheduler", parser.parse_args([]), "/m")))
    bad = parser.parse_args(["--speculative-model", "ngram", "--num-speculative-tokens", "3",
                             "--ngram-prompt-lookup-min", "5"])
    assert "prompt_lookup_min <= prompt_lookup_max" in speculative_refusal(bad)


def test_adapters_with_speculation_are_refused_at_start(tiny_pair, capsys):
    import argparse

    from folio.services.serve import add_serve_args, serve

    with pytest.raises(ValueError, match="--enable-lora"):
        make_runner(tiny_pair[0], speculative_config='{"method": "ngram"}', enable_lora=True)
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    from folio.services.executor.main import parse_config as executor_config
    from folio.services.scheduler.main import parse_config as scheduler_config
    from folio.services.serve import service_argv

    text = '{"method": "suffix", "num_speculative_tokens": 5}'
    args = parser.parse_args(["--model", tiny_pair[0], "--speculative-config", text])
    assert executor_config(service_argv("executor", args, tiny_pair[0])).runtime.speculative_config == text
    assert speculative_settings(scheduler_config(service_argv("scheduler", args, tiny_pair[0]))).method == "suffix"
    for extra, said in [(["--enable-lora"], LORA_REFUSAL), ([], "not an eagle3 draft head")]:
        args = parser.parse_args(["--model", tiny_pair[0], "--speculative-config",
                                  '{"method": "suffix"}' if extra else '{"method": "eagle3", "model": "/nowhere"}',
                                  *extra])
        assert serve(args) == 2
        assert said in capsys.readouterr().err


# --------------------------------------------------------------------------- lossless


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    from tests.executor.test_spec_decode import write_target_and_draft

    return write_target_and_draft(tmp_path_factory, "suffix", 64)


def test_suffix_speculation_is_lossless_with_caching_preemption_and_choices(tiny_pair):
    """Two waves of the same prompts (the second drafts from the first's answers), n = 2 choices,
    in a pool small enough to preempt: the greedy tokens are plain decoding's. Drafting every step
    (not adaptive): what the controller chooses would hang on this machine's load, and the
    controller's own tests drive it with given timings."""
    target, _ = tiny_pair
    prompts = repetitive_prompts(6, seed=21)

    def wave(tag):
        return [engine_request(f"{tag}{i}", p, 24, ignore_eos=True, fork_req_ids=[f"{tag}{i}-1"])
                for i, p in enumerate(prompts)]

    plain_runner = make_runner(target, num_kv_blocks=40)
    spec_runner = make_runner(target, num_kv_blocks=40, speculative_config='{"method": "suffix", '
                              '"num_speculative_tokens": 6, "prompt_lookup_min": 2, "adaptive": false}')
    preempted = 0
    for tag in ("first", "second"):
        _, plain = run(plain_runner, wave(tag))
        engine, fast = run(spec_runner, wave(tag))
        assert fast == plain
        assert engine.alloc.num_used_blocks == 0
        preempted += engine.sched.counters["num_preemptions"]
    assert preempted > 0
    assert engine.sched.counters["num_spec_accepted_tokens"] > 0
    stats = spec_runner.stats()
    assert stats["suffix_drafts_from_trie"] > 0 and stats["suffix_cached_requests"] > 0


class Alternating(SpecController):
    """Drafts every other decision: both arms, and their switches, in one short run."""

    def choose(self, num_rows: int) -> bool:
        super().choose(num_rows)
        return sum(self.num_steps) % 2 == 0


def test_steps_without_drafts_ahead_are_planned_ahead_and_the_output_stays(tiny_pair):
    """A decision not to draft is made a step ahead and said in the result, so the scheduler
    plans the next step before the result (placeholders) as it does without speculation."""
    target, _ = tiny_pair
    reqs = [engine_request(f"r{i}", p, 20, ignore_eos=True) for i, p in enumerate(repetitive_prompts(4, seed=8))]
    _, plain = run(make_runner(target), reqs)
    runner = make_runner(target, speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    runner.spec_control = Alternating()
    engine, fast = run(runner, reqs, async_scheduling=True)
    assert fast == plain
    assert any(plan.num_placeholder_tokens for plan in engine.plans)  # planned ahead of a result
    assert engine.sched.counters["num_spec_accepted_tokens"] > 0  # and drafts verified in between


def test_a_shrinking_batch_carries_a_clear_loss_down_and_still_tries_again_later():
    def run(ctl: SpecController, rows: int, spec_s: float, plain_s: float, num: int) -> list[bool]:
        out = []
        for _ in range(num):
            speculate = ctl.choose(rows)
            ctl.proposed(rows, speculate, 0.0)
            ctl.observe(spec_s if speculate else plain_s, rows, True)
            out.append(speculate)
        return out

    ctl = SpecController(clear_ratio=1.5)
    assert sum(run(ctl, 32, 0.027, 0.010, 10)) == 1  # batch 32: one try, a 2.7x loss
    smaller = run(ctl, 20, 0.016, 0.008, 130)  # 16-31 rows: no try until the interval of a 2.7x loss (116)
    assert sum(smaller[:100]) == 0 and sum(smaller) == 1
    assert ctl.buckets[5].rate[0] == pytest.approx(20 / 0.008)  # its own plain rate, not batch 32's
    close = SpecController(clear_ratio=1.5)
    run(close, 32, 0.012, 0.010, 10)  # a close call at batch 32 says nothing about 16-31 rows
    assert run(close, 20, 0.006, 0.008, 1) == [True]


def test_a_decision_measured_a_step_late_is_not_tried_twice():
    """As the runner asks: at step N it measures step N (drafted as decided at N - 2), decides for
    N + 2, and proposes for N + 1 as decided at N - 1; a decision is made before the one before it
    is measured."""
    ctl, out, drafts_now = SpecController(min_samples=3, clear_ratio=1.5), [], True
    ctl.first_decision(drafts_now)  # the runner's first proposing drafts, before any decision
    for step in range(20):
        if ctl.pending is not None:  # step 0 is the prefill; every later one decodes
            ctl.observe(0.027 if ctl.pending[1] else 0.010, 32, decode_only=True)
        speculate, drafts_now = drafts_now, ctl.choose(32)
        ctl.proposed(32, speculate, 0.0)
        out.append(drafts_now)
    assert sum(out) == 0  # the first proposing was the one try; its comparison settles it


def test_the_closed_payoff_counts_the_row_furthest_behind():
    """One row of four gains 4 tokens a drafting step, the others 1: a server (rows refilled)
    gains 7 tokens for 4 in the time of 1.2 plain steps, drafting wins; a closed batch ends with its
    laggard, which gains 1 token either way, so drafting loses."""
    def spec_share(payoff: str) -> float:
        ctl, out = SpecController(min_samples=2, payoff=payoff), []
        for _ in range(120):
            speculate = ctl.choose(4)
            ctl.proposed(4, speculate, 0.0)
            gains = {"a": 4, "b": 1, "c": 1, "d": 1} if speculate else dict.fromkeys("abcd", 1)
            ctl.observe(0.012 if speculate else 0.010, sum(gains.values()), True, gains)
            out.append(speculate)
        assert ctl.stats()["spec_payoff"] == payoff
        return sum(out[20:]) / len(out[20:])

    assert spec_share("served") > 0.9
    assert spec_share("closed") < 0.1
    ctl = SpecController(payoff="closed")  # how far the fewest tokens so far moved, once per row
    assert ctl._laggard_tokens({"a": 4, "b": 1}) == 2 * 1  # 0 -> 1 (b)
    assert ctl._laggard_tokens({"a": 1, "b": 5}) == 2 * 4  # 1 (b) -> 5 (a)
    assert ctl._laggard_tokens({"b": 2}) == 2 and ctl.progress == {"b": 8}  # a finished: forgotten
    with pytest.raises(ValueError, match="payoff"):
        SpecController(payoff="open")
