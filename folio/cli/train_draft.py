"""``folio train-draft --out DIR [--model M]``: train an eagle3 draft head for a model, on this machine.

More in docs/modules.md (folio/cli/train_draft.py).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

PROMPT_TEMPLATES = [
    "Explain {t} in simple terms.", "What is {t}? Answer in a short paragraph.",
    "Give me three tips about {t}.", "Write a short poem about {t}.", "Why does {t} matter?",
    "Summarize what you know about {t} in a few sentences.", "Write a short story that involves {t}.",
    "What are the pros and cons of {t}?", "How would you explain {t} to a child?",
    "List five facts about {t}.", "Write an email to a friend about {t}.", "What is a common misconception about {t}?",
    "Describe the history of {t} briefly.", "Give a step-by-step guide related to {t}.",
    "Compare {t} with something similar and explain the difference.", "Write a haiku about {t}.",
    # the wider set: questions as people type them into a chat
    "Can you help me understand {t}?", "I'm curious about {t}. Where should I start?",
    "Tell me something surprising about {t}.", "What do beginners get wrong about {t}?",
    "Write a short dialogue between two friends talking about {t}.", "Give me a quick overview of {t}.",
    "What questions should I ask an expert on {t}?", "Make a packing or shopping list related to {t}.",
    "Write a limerick about {t}.", "Explain {t} in one paragraph, then give an example.",
    "What would the world look like without {t}?", "Describe {t} to someone who has never heard of it.",
    "Give me two arguments for and two against {t}.", "Write a tweet-length summary of {t}.",
    "How has {t} changed over the last hundred years?", "What are the first three steps to learn about {t}?",
    "Write a short product description inspired by {t}.", "Teach me one useful thing about {t} today.",
    "What is the most important idea behind {t}?", "Write a four-line rhyme about {t} for a child.",
]
TOPICS = [  # none of them is a topic of folio.bench.spec_decode's chat prompts, which measure the head
    "the water cycle", "glaciers", "machine learning", "origami", "the Roman Empire", "volcanoes", "saving money",
    "learning a new language", "the internet", "honey bees", "electric cars", "the moon", "friendship", "coffee",
    "recycling", "the human heart", "chess", "gardening", "the stock market", "rainbows", "dinosaurs",
    "music theory", "bread baking", "time management", "the solar system", "vaccines", "public speaking",
    "ocean tides", "renewable energy", "mountains", "the printing press", "democracy", "programming in Python",
    "a job interview", "traveling by train", "the immune system", "writing a resume", "the color blue",
    "bicycles", "deserts", "the French Revolution", "meditation", "robots", "cooking pasta",
    "the Great Wall of China", "smartphones", "libraries", "a rainy day", "teamwork", "mathematics", "city parks",
    "the Silk Road", "bridges", "board games", "jazz", "submarines", "the Olympic Games", "maps",
    "kites", "the Amazon rainforest", "penguins", "budgeting for a holiday", "composting", "the Moon landing",
    "earthworms", "hiking boots", "solar panels", "the Renaissance", "tea", "wind turbines", "snowflakes",
    "spreadsheets", "first aid", "castles", "the metric system", "owls", "running a marathon",
    "video games", "pottery", "the Nile", "thunderstorms", "sourdough", "learning to swim", "lighthouses",
    "the periodic table", "podcasts", "yoga", "train stations", "coral reefs", "handwriting", "sailing",
    "a birthday party", "houseplants", "the Eiffel Tower", "telescopes", "cheese", "elections", "fossils",
    "knitting", "the speed of light", "wolves", "moving to a new city", "clocks", "chocolate", "museums",
    "the human brain", "skateboarding", "paper", "bees and flowers", "online privacy", "a picnic",
]
LOSS_DECAY = 0.8


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="folio train-draft", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="the target (default: folio serve's default model)")
    p.add_argument("--out", required=True, help="the head's folder (data, checkpoint, head and card go there)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-prompts", type=int, default=256, help="prompts answered for the data")
    p.add_argument("--max-tokens", type=int, default=192, help="longest answer")
    p.add_argument("--heldout", type=float, default=0.1, help="share of the answers kept for the acceptance figure")
    p.add_argument("--draft-vocab", type=int, default=8192, help="the draft vocabulary's size")
    p.add_argument("--intermediate-size", type=int, default=None, help="the head's MLP width (default: the target's)")
    p.add_argument("--depth", type=int, default=3, help="drafting steps unrolled in training")
    p.add_argument("--k", type=int, default=3, help="drafts per verification in the acceptance figure")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per training step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--token-budget", type=int, default=2_000_000, help="stop after training on this many tokens")
    p.add_argument("--minutes", type=float, default=60.0, help="stop after this much training time (all runs)")
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    p.add_argument("--max-num-seqs", type=int, default=32, help="answers generated at once")
    p.add_argument("--quantization", default="auto", help="the target's weights, as folio serve takes them")
    p.add_argument("--compare", default=None, help="a head folder (\"shipped\": the packaged one) to measure on the "
                                                   "same held-out answers; its figure goes into the card")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.depth < 1 or args.k < 1 or args.num_prompts < 2 or not 0 < args.heldout < 1:
        print("folio train-draft: need --depth >= 1, --k >= 1, --num-prompts >= 2, 0 < --heldout < 1",
              file=sys.stderr)
        return 2
    try:
        card = train(args, "folio train-draft " + " ".join(sys.argv[1:] if argv is None else argv))
    except ValueError as exc:
        print(f"folio train-draft: {exc}", file=sys.stderr)
        return 2
    print(f"held-out acceptance length {card['heldout_acceptance_length']:.3f} (k={args.k}); head in {args.out}")
    return 0


def make_prompts(num: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    pairs = [(t, s) for t in PROMPT_TEMPLATES for s in TOPICS]
    rng.shuffle(pairs)
    return [pairs[i % len(pairs)][0].format(t=pairs[i % len(pairs)][1]) for i in range(num)]


def collect(llm, args) -> list[dict]:
    """The model's greedy answers: ``[{"prompt": ids, "answer": ids}]``."""
    from folio import SamplingParams

    prompts = make_prompts(args.num_prompts, args.seed)
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts],
                    SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    return [{"prompt": list(o.prompt_token_ids), "answer": list(o.outputs[0].token_ids)} for o in outs
            if len(o.outputs[0].token_ids) >= 2]


def features(runner, token_ids: list[int]) -> torch.Tensor:
    """The target's tapped residuals and final output over ``token_ids`` ``[n, 3 hidden]``."""
    from folio.core.executor.kernels.attention import AttentionMetadata
    from folio.core.kv.tensors.pool import KVPool

    bs, n = runner.pool.block_size, len(token_ids)
    pool = KVPool(runner.pool_shape, -(-n // bs), runner.device)
    meta = AttentionMetadata.build([n], [n], [list(range(pool.num_blocks))], None, bs, runner.device)
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(token_ids, device=runner.device), meta.positions, pool.kv_caches, meta,
                              runner.backend)
        return torch.cat([*runner.model.tapped, hidden.float()], dim=-1).to(torch.float16).cpu()


def _settings(args) -> dict:
    return {k: getattr(args, k) for k in ("model", "seed", "num_prompts", "max_tokens", "quantization", "heldout",
                                          "draft_vocab", "intermediate_size", "depth", "batch_size", "lr")}


def _answers(llm, args, model_name: str, out: Path, settings: dict) -> list[dict]:
    """The model's answers to the prompts (read back from ``data.json`` when made with these settings)."""
    data_file = out / "data.json"
    data = json.loads(data_file.read_text()) if data_file.exists() else None
    if data is None or data["settings"] != {k: settings[k] for k in data["settings"]}:
        print(f"answering {args.num_prompts} prompts with {model_name} ...", file=sys.stderr)
        data = {"settings": {k: settings[k] for k in ("model", "seed", "num_prompts", "max_tokens", "quantization")},
                "sequences": collect(llm, args)}
        data_file.write_text(json.dumps(data))
    return data["sequences"]


def _split(seqs: list[dict], args) -> tuple[list[dict], list[dict]]:
    """(held out, trained on): a seeded shuffle, the held-out share kept apart."""
    order = list(range(len(seqs)))
    random.Random(args.seed).shuffle(order)
    num_held = max(1, round(len(seqs) * args.heldout))
    return [seqs[i] for i in order[:num_held]], [seqs[i] for i in order[num_held:]]


def _new_head(runner, trained: list[dict], args):
    """A head for the target, its draft vocabulary the trained answers' most frequent tokens; and the
    map from target to draft ids (-100: not in the draft vocabulary)."""
    from folio.core.executor.runtime.spec_eagle import EagleHead, HeadConfig

    counts = torch.zeros(runner.spec.vocab_size, dtype=torch.long)
    for s in trained:
        counts += torch.bincount(torch.tensor(s["answer"]), minlength=len(counts))
    cfg = HeadConfig.for_target(runner.spec, args.draft_vocab, args.intermediate_size)
    head = EagleHead(cfg)
    vocab = sorted(range(len(counts)), key=lambda t: (-int(counts[t]), t))[:cfg.draft_vocab_size]
    head.draft_to_target.copy_(torch.tensor(vocab))
    runner.model.taps = cfg.taps
    head.attach(runner.model)
    target_to_draft = torch.full((runner.spec.vocab_size,), -100, dtype=torch.long)
    target_to_draft[head.draft_to_target] = torch.arange(cfg.draft_vocab_size)
    return head, target_to_draft


def _resume(head, optim, ckpt_file: Path, settings: dict) -> dict:
    """The training state of ``checkpoint.pt`` when made with these settings (head and optimizer
    restored), else a fresh one."""
    state = {"step": 0, "tokens": 0, "seconds": 0.0, "epoch": 0, "cursor": 0}
    if ckpt_file.exists():
        ckpt = torch.load(ckpt_file, weights_only=True)
        if ckpt["settings"] == settings:
            head.load_state_dict(ckpt["head"])
            optim.load_state_dict(ckpt["optim"])
            state = ckpt["state"]
            print(f"resuming at step {state['step']} ({state['tokens']} tokens)", file=sys.stderr)
        else:
            print("checkpoint.pt was made with other settings: starting over", file=sys.stderr)
    return state


def _train_loop(head, trained, feat_of, target_to_draft, args, out: Path, settings: dict) -> dict:
    """Steps of ``args.batch_size`` answers until the token budget or the minutes are spent,
    checkpointed every ``args.checkpoint_every`` steps and at the end; the final state."""
    from tqdm import tqdm

    params = [p for p in head.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    ckpt_file = out / "checkpoint.pt"
    state = _resume(head, optim, ckpt_file, settings)

    def save_checkpoint():
        torch.save({"settings": settings, "head": head.state_dict(), "optim": optim.state_dict(), "state": state},
                   ckpt_file)

    bar = tqdm(total=args.token_budget, initial=min(state["tokens"], args.token_budget), unit="tok",
               desc="train-draft", file=sys.stderr)
    head.train()
    while state["tokens"] < args.token_budget and state["seconds"] < args.minutes * 60:
        start = time.perf_counter()
        epoch_order = list(range(len(trained)))
        random.Random(args.seed * 1000 + state["epoch"]).shuffle(epoch_order)
        batch = [trained[epoch_order[(state["cursor"] + j) % len(trained)]] for j in range(args.batch_size)]
        loss, num_tokens = _loss(head, batch, feat_of, target_to_draft, args.depth)
        optim.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        state["cursor"] += args.batch_size
        if state["cursor"] >= len(trained):
            state["epoch"], state["cursor"] = state["epoch"] + 1, 0
        state["step"] += 1
        state["tokens"] += num_tokens
        state["seconds"] += time.perf_counter() - start
        bar.update(num_tokens)
        bar.set_postfix(loss=f"{loss.item():.3f}", epoch=state["epoch"])
        if state["step"] % args.checkpoint_every == 0:
            save_checkpoint()
    bar.close()
    save_checkpoint()
    head.eval()
    return state


def train(args, command: str) -> dict:
    from folio import LLM
    from folio.core.executor.runtime.spec_eagle import save_head, target_fingerprint
    from folio.shared.config import DEFAULT_MODEL_NAME

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    model_name = args.model or DEFAULT_MODEL_NAME
    llm = LLM(model_name, quantization=args.quantization, max_num_seqs=args.max_num_seqs, device="cpu")
    runner = llm.engine.core.runner
    settings = _settings(args)
    seqs = _answers(llm, args, model_name, out, settings)
    held, trained = _split(seqs, args)
    head, target_to_draft = _new_head(runner, trained, args)
    print(f"hidden states of {len(seqs)} answers ...", file=sys.stderr)
    feat_of = {id(s): features(runner, s["prompt"] + s["answer"]) for s in seqs}
    state = _train_loop(head, trained, feat_of, target_to_draft, args, out, settings)
    acceptance = heldout_acceptance(head, held, feat_of, args.k)
    compared = _compare(args, runner, held, feat_of)
    card = {"target": {"fingerprint": target_fingerprint(runner.model), "model": model_name,
                       "quantization": args.quantization},
            "command": command, "seed": args.seed,
            "data": {"num_sequences": len(seqs), "num_train_sequences": len(trained), "num_heldout_sequences": len(held),
                     "num_answer_tokens": sum(len(s["answer"]) for s in seqs)},
            "training": {"steps": state["step"], "tokens": state["tokens"], "minutes": round(state["seconds"] / 60, 2),
                         "depth": args.depth},
            "heldout_acceptance_length": acceptance, "heldout_k": args.k}
    if compared is not None:
        card["compared"] = compared
    save_head(head, out, card)
    return card


def _compare(args, runner, held: list[dict], feat_of: dict) -> dict | None:
    """Another head's acceptance on the same held-out answers (``--compare``), or None."""
    from folio.core.executor.runtime.spec_eagle import load_head, read_card, shipped_head

    if args.compare is None:
        return None
    folder = shipped_head(runner.model) if args.compare == "shipped" else Path(args.compare)
    other = load_head(folder, runner.model, torch.float32, torch.device("cpu"))
    if tuple(other.cfg.taps) != tuple(runner.model.taps):  # the held-out features are this head's layers
        raise ValueError(f"{folder}: its head reads layers {other.cfg.taps}, this one {runner.model.taps}")
    acceptance = heldout_acceptance(other, held, feat_of, args.k)
    print(f"{folder}: held-out acceptance length {acceptance:.3f} on the same answers", file=sys.stderr)
    return {"head": folder.name if args.compare == "shipped" else str(folder),
            "command": read_card(folder).get("command", ""), "heldout_acceptance_length": acceptance}


def _pad(batch: list[dict], feat_of: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded features ``[B, T, 3h]``, token ids ``[B, T + 1]`` (-1 past the end) and answer starts."""
    lens = [len(s["prompt"]) + len(s["answer"]) for s in batch]
    num = max(lens)
    feats = torch.zeros(len(batch), num, feat_of[id(batch[0])].shape[1])
    ids = torch.full((len(batch), num + 1), -1, dtype=torch.long)
    for b, s in enumerate(batch):
        feats[b, :lens[b]] = feat_of[id(s)].float()
        ids[b, :lens[b]] = torch.tensor(s["prompt"] + s["answer"])
    return feats, ids, torch.tensor([len(s["prompt"]) for s in batch])


def _labels(ids: torch.Tensor, answer_start: torch.Tensor, step: int) -> torch.Tensor:
    """Step ``step``'s target at index ``i``: token ``i + 2`` where it is an answer token and the
    chain exists (``i >= step``); -1 elsewhere."""
    num = ids.shape[1] - 1
    label = torch.full_like(ids[:, :num], -1)
    label[:, :num - 1] = ids[:, 2:num + 1]
    idx = torch.arange(num)
    keep = (idx[None, :] + 2 >= answer_start[:, None]) & (idx[None, :] >= step)
    return torch.where(keep, label, torch.full_like(label, -1))


def _loss(head, batch, feat_of, target_to_draft, depth: int) -> tuple[torch.Tensor, int]:
    feats, ids, answer_start = _pad(batch, feat_of)
    next_ids = ids[:, 1:].clamp(min=0)
    logits = head.unrolled(feats, next_ids, depth)
    total, weight = 0.0, 0.0
    for d, lg in enumerate(logits):
        label = _labels(ids, answer_start, d)
        draft_label = torch.where(label >= 0, target_to_draft[label.clamp(min=0)], torch.full_like(label, -100))
        total = total + LOSS_DECAY ** d * F.cross_entropy(lg.flatten(0, 1).float(), draft_label.flatten(),
                                                          ignore_index=-100)
        weight += LOSS_DECAY ** d
    return total / weight, int((ids >= 0).sum())


@torch.no_grad()
def heldout_acceptance(head, held: list[dict], feat_of: dict, k: int) -> float:
    """1 + the mean number of drafts accepted when a greedy chain of ``k`` starts at each answer
    position of the held-out answers (what a verification of the proposer's drafts keeps)."""
    accepted, starts = 0, 0
    for s in held:
        feats, ids, answer_start = _pad([s], feat_of)
        logits = head.unrolled(feats, ids[:, 1:].clamp(min=0), k)
        num = ids.shape[1] - 1
        right = []  # right[d][i]: step d at index i drafts token i + 2 correctly
        for d, lg in enumerate(logits):
            pred = head.draft_to_target[lg[0].argmax(-1)]
            label = _labels(ids, answer_start, 0)[0]
            right.append((pred == label) & (label >= 0))
        for i in range(max(0, int(answer_start[0]) - 2), num - 1):
            n = 0
            while n < k and i + n < num and bool(right[n][i + n]):
                n += 1
            accepted += n
            starts += 1
    return 1.0 + accepted / max(starts, 1)
