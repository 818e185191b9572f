"""``--speculative-config``: which proposer drafts tokens and how many, in vLLM's JSON form.

    --speculative-config '{"method": "suffix", "num_speculative_tokens": 8}'
    LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4})

The executor reads it to build its proposer (``folio.core.executor.runtime.spec_decode``); the
scheduler asks only whether steps carry drafts (``speculation_on``: each waits for the last one's result).
The older flags (``--speculative-model ngram|DIR``, ``--num-speculative-tokens``,
``--ngram-prompt-lookup-min/max``, ``--speculative-disable-by-batch-size``) stay as aliases: they
are turned into the same settings here, so there is one place that decides what was asked for.
Pure Python: the services import it without torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "suffix", "draft_model", "eagle3")
PAYOFFS = ("served", "closed")  # what the adaptive choice counts as a step's gain (spec_control.SpecController)
DEFAULT_NUM_TOKENS = {"ngram": 4, "suffix": 8, "draft_model": 3, "eagle3": 3}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None  # draft_model: the draft's folder or name; eagle3: the head's folder (None: the shipped one)
    prompt_lookup_min: int = 1  # ngram (and the suffix proposer's own-request lookup)
    prompt_lookup_max: int = 4
    disable_by_batch_size: int = 0  # propose nothing while this many requests sample in a step (0: never)
    adaptive: bool = True  # choose per step between speculating and not from measured speed
    # what the choice counts as a step's gain (spec_control.SpecController): "served" (rows that
    # finish are refilled: every token) or "closed" (a fixed batch run to its end: the laggard's)
    payoff: str = "served"
    # suffix: how deep the shared tree goes, how many requests' tokens it remembers, and how many
    # tokens a match may propose per token matched (Arctic Inference's max_spec_factor)
    suffix_max_depth: int = 32
    suffix_max_cached_requests: int = 1000
    suffix_max_spec_factor: float = 1.0
    suffix_min_token_prob: float = 0.1  # stop a draft where the tree's branch share falls below this
    # eagle3: a static tree of drafts verified in one step, as paths of child ranks from the last
    # token (``[[0], [1], [0, 0]]``: the head's top two tokens, and its top one after the first),
    # or true for ``default_tree(num_speculative_tokens)``; the controller then chooses chain or
    # tree per step (always the tree when not adaptive). None: chains only
    tree: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not one of {', '.join(METHODS)}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}")
        if self.method == "draft_model" and not self.model:
            raise ValueError('the draft_model method needs "model": a draft folder or model name')
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min}, "
                             f"{self.prompt_lookup_max}")
        if self.payoff not in PAYOFFS:
            raise ValueError(f'speculative-config payoff must be "served" or "closed", not {self.payoff!r}')
        if self.suffix_max_depth < 2 or self.suffix_max_cached_requests < 1 or self.suffix_max_spec_factor <= 0:
            raise ValueError("suffix_max_depth >= 2, suffix_max_cached_requests >= 1 and suffix_max_spec_factor > 0")
        if self.tree is not None:
            if self.method != "eagle3":
                raise ValueError(f'speculative-config "tree" is for the eagle3 method, not {self.method}')
            check_tree(self.tree)


MAX_TREE_NODES = 15  # a tree's root and nodes fill at most one 16-row verification chunk


def default_tree(k: int) -> tuple[tuple[int, ...], ...]:
    """``k`` nodes, as many as a chain of k verifies: the head's top two tokens, then its best
    path on from the first to depth k - 1. On SmolLM2's chat its first draft is the one most
    often wrong, and its second choice there is right more often than a k-th draft on the chain
    (accepted length 1.68 against 1.44 at k = 4, docs/speculative.md)."""
    if k < 2:
        return ((0,),)
    return ((1,),) + tuple((0,) * d for d in range(1, k))


def check_tree(paths) -> None:
    """ValueError unless ``paths`` is a tree of child ranks whose every path's parent is there too."""
    if not paths or not all(isinstance(p, tuple) and p and all(isinstance(r, int) and not isinstance(r, bool)
                                                               and r >= 0 for r in p) for p in paths):
        raise ValueError('speculative-config "tree" must be true or a list of paths of child ranks >= 0, '
                         'such as [[0], [1], [0, 0]]')
    have = set(paths)
    missing = [list(p) for p in paths if len(p) > 1 and p[:-1] not in have]
    if missing:
        raise ValueError(f'speculative-config "tree": paths {missing} lack their parent path')
    if len(have) != len(paths) or len(paths) > MAX_TREE_NODES:
        raise ValueError(f'speculative-config "tree": {len(paths)} paths, each once and at most {MAX_TREE_NODES}')


_KEYS = {f.name for f in fields(SpeculativeConfig)}


def parse_speculative_config(text_or_dict) -> SpeculativeConfig:
    """The settings from ``--speculative-config`` (a JSON object) or ``LLM``'s dict; ValueError
    with the reason for anything else."""
    if isinstance(text_or_dict, str):
        try:
            value = json.loads(text_or_dict)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not JSON: {exc}") from None
    else:
        value = text_or_dict
    if not isinstance(value, dict):
        raise ValueError('--speculative-config must be a JSON object such as {"method": "ngram", '
                         '"num_speculative_tokens": 4}')
    unknown = sorted(set(value) - _KEYS)
    if unknown:
        raise ValueError(f"unknown speculative-config key(s) {', '.join(unknown)}; known: {', '.join(sorted(_KEYS))}")
    method = value.get("method")
    if method is None:
        raise ValueError(f'speculative-config needs "method": one of {", ".join(METHODS)}')
    value = {"num_speculative_tokens": DEFAULT_NUM_TOKENS.get(method, 1), **value}
    tree = value.get("tree")
    if tree is True:
        value["tree"] = default_tree(value["num_speculative_tokens"]) if isinstance(value["num_speculative_tokens"],
                                                                                   int) else None
    elif tree is False:
        value["tree"] = None
    elif tree is not None:
        if not isinstance(tree, (list, tuple)) or not all(isinstance(p, (list, tuple)) for p in tree):
            raise ValueError('speculative-config "tree" must be true or a list of paths such as [[0], [1], [0, 0]]')
        value["tree"] = tuple(tuple(p) for p in tree)
    for key, kind in (("num_speculative_tokens", int), ("prompt_lookup_min", int), ("prompt_lookup_max", int),
                      ("disable_by_batch_size", int), ("suffix_max_depth", int),
                      ("suffix_max_cached_requests", int)):
        if key in value and (not isinstance(value[key], kind) or isinstance(value[key], bool)):
            raise ValueError(f"speculative-config {key} must be an integer, got {value[key]!r}")
    return SpeculativeConfig(**value)


def speculative_settings(config) -> SpeculativeConfig | None:
    """What a runtime (or scheduler) config asks for: ``speculative_config``, else the older
    flags, else None (no speculative decoding)."""
    given = getattr(config, "speculative_config", None)
    legacy = getattr(config, "speculative_model", None)
    if given:
        if legacy:
            raise ValueError("give --speculative-config or --speculative-model, not both")
        return parse_speculative_config(given)
    if not legacy:
        return None
    k = getattr(config, "num_speculative_tokens", None)
    if k is None or k < 1:
        raise ValueError("--speculative-model needs --num-speculative-tokens of at least 1")
    method = legacy if legacy in ("ngram", "suffix") else "draft_model"
    # a flag not given is missing (a runtime config) or None (``folio serve``'s flags, which
    # forward only what was given): either way SpeculativeConfig's own default holds
    given = {field: getattr(config, flag, None) for field, flag in LEGACY_FLAGS.items()}
    return SpeculativeConfig(method=method, num_speculative_tokens=k,
                             model=legacy if method == "draft_model" else None,
                             **{field: value for field, value in given.items() if value is not None},
                             adaptive=False)  # the older flags keep their fixed behaviour


# SpeculativeConfig's fields that an older flag sets (the flag's config field: its default is the same)
LEGACY_FLAGS = {"prompt_lookup_min": "ngram_prompt_lookup_min", "prompt_lookup_max": "ngram_prompt_lookup_max",
                "disable_by_batch_size": "speculative_disable_by_batch_size"}


def speculation_on(config) -> bool:
    """Whether a config asks for speculative decoding: all the scheduler needs to know (its steps
    then wait for the last one's result). It takes ``--speculative-model`` but not the executor's
    other older flags; what is asked for is the executor's to read, and ``folio serve`` refuses a
    bad request before any service starts."""
    return bool(getattr(config, "speculative_config", None) or getattr(config, "speculative_model", None))


def speculative_refusal(config) -> str | None:
    """Why this config's speculative decoding cannot start (said once, before anything loads),
    or None. Adapters are refused: the proposers and the verifier are not built per adapter."""
    try:
        settings = speculative_settings(config)
    except ValueError as exc:
        return str(exc)
    if settings is not None and getattr(config, "enable_lora", False):
        return LORA_REFUSAL
    if settings is not None and settings.method == "eagle3" and settings.model is not None:
        import os

        if not os.path.isfile(os.path.join(settings.model, "card.json")):
            return (f"{settings.model} is not an eagle3 draft head: no card.json there (folio train-draft writes "
                    "one; leave \"model\" out for the head shipped for the served model)")
    return None


LORA_REFUSAL = ("speculative decoding does not run with --enable-lora: the draft model knows no adapter and "
                "verification with adapters is untested; serve adapters without speculation")
