"""``folio train-draft`` on a tiny chat model: data, training, resuming, the head's card, and the
head it writes serving losslessly."""

from __future__ import annotations

import json

import pytest
import torch

from folio.cli.train_draft import main as train_draft
from folio.testing.models import write_tiny_chat_model


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory, smollm_tokenizer_dir):
    return write_tiny_chat_model(tmp_path_factory.mktemp("draft-target"), smollm_tokenizer_dir)


def args(model: str, out, **extra) -> list[str]:
    base = {"--model": model, "--out": str(out), "--num-prompts": 6, "--max-tokens": 12, "--draft-vocab": 256,
            "--intermediate-size": 32, "--batch-size": 2, "--checkpoint-every": 2, "--quantization": "none",
            "--max-num-seqs": 8, **extra}
    return [str(x) for kv in base.items() for x in kv]


def test_train_draft_writes_a_head_that_serves_and_resumes_from_its_checkpoint(tiny_chat, tmp_path, capsys):
    out = tmp_path / "head"
    assert train_draft(args(tiny_chat, out, **{"--token-budget": 200})) == 0
    card = json.loads((out / "card.json").read_text())
    assert "held-out acceptance length" in capsys.readouterr().out
    assert card["seed"] == 0 and card["data"]["num_sequences"] == 6 and card["command"].startswith("folio train-draft")
    assert card["target"]["fingerprint"] and 1.0 <= card["heldout_acceptance_length"] <= 4.0
    first = card["training"]
    assert first["tokens"] >= 200 and first["steps"] >= 1
    ckpt = torch.load(out / "checkpoint.pt", weights_only=False)
    assert ckpt["state"]["step"] == first["steps"]
    # a larger budget continues from the checkpoint: the step count goes on, the data is reused
    data_mtime = (out / "data.json").stat().st_mtime
    assert train_draft(args(tiny_chat, out, **{"--token-budget": 400})) == 0
    assert "resuming at step" in capsys.readouterr().err
    second = json.loads((out / "card.json").read_text())["training"]
    assert second["steps"] > first["steps"] and second["tokens"] >= 400
    assert (out / "data.json").stat().st_mtime == data_mtime
    # --compare measures another head on the same held-out answers (the same seed and prompts: the
    # same split) and writes its figure into the card; the head in out was saved in fp16
    other = tmp_path / "other"
    assert train_draft(args(tiny_chat, other, **{"--token-budget": 100, "--compare": str(out)})) == 0
    compared = json.loads((other / "card.json").read_text())["compared"]
    assert compared["head"] == str(out) and compared["command"] == json.loads((out / "card.json").read_text())["command"]
    assert abs(compared["heldout_acceptance_length"] - json.loads((out / "card.json").read_text())[
        "heldout_acceptance_length"]) <= 0.25
    # the head serves, and greedy output is plain decoding's
    from folio import LLM, SamplingParams

    prompts = ["Explain the moon in simple terms.", "Write a haiku about cats."]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(tiny_chat, quantization="none").generate(prompts, params, False)]
    spec = LLM(tiny_chat, quantization="none", speculative_config={"method": "eagle3", "model": str(out),
                                                                     "num_speculative_tokens": 3, "adaptive": False})
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, False)] == plain
    assert spec.engine.core.runner.proposer.num_proposals > 0


def test_train_draft_says_what_is_wrong(tmp_path, capsys):
    assert train_draft(["--out", str(tmp_path), "--depth", "0"]) == 2
    assert "--depth >= 1" in capsys.readouterr().err
