"""Embeddings throughput on the CPU: ``folio.LLM(task="embed").embed`` against sentence-transformers'
``encode`` on the same model and the same texts, in one run, with the same pooling (last token,
L2-normalised; an encoder-only model's own, from its sentence-transformers files) and fp32 weights on
both sides.

The texts are ``--num-inputs`` spans of a fixed word list, ``--min-tokens`` to ``--max-tokens``
tokens each (uniform, seeded). Each side embeds a few texts first (kernels, allocator and caches
warm), then all of them once, timed; the embeddings are compared (the smallest cosine printed), so
a fast wrong answer shows. sentence-transformers batches by length (``--st-batch-size``) with
padding; folio schedules the inputs through its paged prefill under ``--max-num-batched-tokens``,
on its C kernels by default (``--attention-backend cpu``: the whole layer stack in one call; ``torch``
is the reference backend, about half as fast here). ``--threads`` sets torch's threads for both
(default: torch's own choice).

    folio bench embed [--model PATH] [--num-inputs 256] [--min-tokens 64] [--max-tokens 512]

``--mixed`` measures instead what embeddings cost a served chat: one ``folio serve --task
generate,embed`` (the model as served, ``--quantization auto``), ``--chat-streams`` greedy chat
completions alone, then the same completions while the ``--num-inputs`` texts arrive at once as
``/v1/embeddings`` requests of ``--inputs-per-request``. It prints the chat's tokens/s (from the
first send to its last answer) both ways and their ratio, whether the chat texts are the same, and
the embeddings' tokens/s.

    folio bench embed --mixed [--chat-streams 16] [--chat-tokens 128] [--inputs-per-request 8]
        [--max-pooling-tokens-per-step N]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from folio.shared.config import DEFAULT_MODEL_NAME

WORDS = ("the harbour lights dim slowly while a ferry crosses the bay and gulls follow it home across grey "
         "water under a low sky where fishermen mend their nets and talk about the weather the price of fuel "
         "and the long winter that is coming to the northern coast").split()


def make_texts(tokenizer, num: int, low: int, high: int, seed: int) -> list[str]:
    """``num`` texts of ``low`` to ``high`` tokens (uniform), cut from the repeated word list."""
    rng = random.Random(seed)
    ids = tokenizer.encode(" ".join(WORDS * (high // len(WORDS) + 2)), add_special_tokens=False)
    texts = []
    for _ in range(num):
        n, start = rng.randint(low, high), rng.randint(0, len(WORDS) - 1)
        texts.append(tokenizer.decode(ids[start:start + n]))
    return texts


def sentence_transformer(path: str):
    """The same checkpoint as a SentenceTransformer: its transformer, last-token pooling, normalised;
    an encoder-only model (BERT) as its own sentence-transformers files say (mean or CLS pooling)."""
    from sentence_transformers import SentenceTransformer, models

    from folio.core.model_files import encoder_only_type

    if encoder_only_type(path) is not None:
        return SentenceTransformer(path, device="cpu", model_kwargs={"dtype": torch.float32})

    # plain text in (sentence-transformers would otherwise wrap each text in the chat template)
    body = models.Transformer(path, model_kwargs={"dtype": torch.float32}, module_output_name="token_embeddings",
                              modality_config={"text": {"method": "forward", "method_output_name": "last_hidden_state"}})
    pooling = models.Pooling(body.get_embedding_dimension(), pooling_mode="lasttoken")
    return SentenceTransformer(modules=[body, pooling, models.Normalize()], device="cpu")


def timed(fn, *args, **kw) -> tuple[object, float]:
    start = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - start


CHAT = ["Why is the sky blue?", "Give me three tips for learning a new language.", "What is a prime number?",
        "Describe a good morning routine.", "How do plants make food from sunlight?",
        "Write a short poem about the sea.", "What causes the seasons on Earth?", "Explain what a database index is."]


async def _mixed_run(base_url: str, model: str, chats: list[str], max_tokens: int,
                     batches: list[list[str]]) -> tuple[float, list[str], float]:
    """The chats (and, at the same moment, the embedding requests): the chat's tokens/s from the
    first send to its last answer, its texts, and the embeddings' seconds to their last answer."""
    import asyncio

    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        async def chat(text: str) -> tuple[int, str]:
            body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                    "temperature": 0}
            async with session.post(base_url + "/chat/completions", json=body) as resp:
                resp.raise_for_status()
                out = await resp.json()
            return out["usage"]["completion_tokens"], out["choices"][0]["message"]["content"]

        async def embed(inputs: list[str]) -> None:
            async with session.post(base_url + "/embeddings", json={"model": model, "input": inputs}) as resp:
                resp.raise_for_status()
                await resp.json()

        async def chats_timed() -> tuple[float, list[tuple[int, str]]]:
            t0 = time.perf_counter()
            done = await asyncio.gather(*(chat(t) for t in chats))
            return time.perf_counter() - t0, done

        async def embeds_timed() -> float:
            t0 = time.perf_counter()
            await asyncio.gather(*(embed(b) for b in batches))
            return time.perf_counter() - t0

        (chat_s, done), embed_s = await asyncio.gather(chats_timed(), embeds_timed() if batches else _zero())
    return sum(n for n, _ in done) / chat_s, [t for _, t in done], embed_s


async def _zero() -> float:
    return 0.0


def mixed(args) -> int:
    """Served chat alone, then beside the embeddings (``--mixed``)."""
    import asyncio

    from transformers import AutoTokenizer

    from folio.core.model_files import resolve_model
    from folio.testing.server import start_server, stop_server

    path = str(resolve_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(path)
    texts = make_texts(tokenizer, args.num_inputs, args.min_tokens, args.max_tokens, args.seed)
    num_tokens = sum(len(tokenizer.encode(t)) for t in texts)
    batches = [texts[i:i + args.inputs_per_request] for i in range(0, len(texts), args.inputs_per_request)]
    chats = [CHAT[i % len(CHAT)] for i in range(args.chat_streams)]
    server = start_server(path, "--task", "generate,embed", "--max-num-seqs", "256",
                          "--max-pooling-inputs", str(args.inputs_per_request),
                          "--max-pooling-tokens-per-step", str(args.max_pooling_tokens_per_step))
    try:
        asyncio.run(_mixed_run(server.base_url, args.model, chats[:1], 4, batches[:1]))  # warm-up
        alone, alone_texts, _ = asyncio.run(_mixed_run(server.base_url, args.model, chats, args.chat_tokens, []))
        beside, beside_texts, embed_s = asyncio.run(_mixed_run(server.base_url, args.model, chats, args.chat_tokens,
                                                               batches))
    finally:
        stop_server(server)
    print(f"model: {path} (folio serve --task generate,embed --max-pooling-tokens-per-step "
          f"{args.max_pooling_tokens_per_step}); {len(chats)} chat streams of up to "
          f"{args.chat_tokens} tokens; {len(texts)} embedding inputs ({num_tokens} tokens) in {len(batches)} requests")
    print(f"chat alone (tokens/s): {alone:.1f}")
    print(f"chat beside the embeddings (tokens/s): {beside:.1f}")
    print(f"chat beside / alone: {beside / alone:.2f} x")
    print(f"chat texts the same as alone: {sum(a == b for a, b in zip(alone_texts, beside_texts))} of {len(chats)}")
    print(f"embeddings beside the chat (tokens/s): {num_tokens / embed_s:.0f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL_NAME)
    ap.add_argument("--num-inputs", type=int, default=256)
    ap.add_argument("--min-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--st-batch-size", type=int, default=32)
    ap.add_argument("--attention-backend", default="cpu", choices=("cpu", "torch", "auto"))
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mixed", action="store_true", help="served chat alone and beside the embeddings")
    ap.add_argument("--chat-streams", type=int, default=16)
    ap.add_argument("--chat-tokens", type=int, default=128)
    ap.add_argument("--inputs-per-request", type=int, default=8)
    ap.add_argument("--max-pooling-tokens-per-step", type=int, default=16,
                    help="--mixed: the server's flag (the embeddings' share of a step while the chat decodes)")
    args = ap.parse_args(argv)
    if args.mixed:
        return mixed(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    from folio import LLM
    from folio.core.model_files import resolve_model

    path = str(resolve_model(args.model))
    llm = LLM(path, task="embed", dtype="float32", quantization="none", max_num_seqs=256,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
              attention_backend=args.attention_backend)
    texts = make_texts(llm.get_tokenizer(), args.num_inputs, args.min_tokens, args.max_tokens, args.seed)
    num_tokens = sum(len(llm.get_tokenizer().encode(t)) for t in texts)
    print(f"model: {path}; {len(texts)} inputs, {num_tokens} tokens; torch threads {torch.get_num_threads()}")
    llm.embed(texts[:4], use_tqdm=False)
    folio_out, folio_s = timed(llm.embed, texts, use_tqdm=False)
    del llm
    st = sentence_transformer(path)
    st.encode(texts[:4], batch_size=args.st_batch_size)
    st_out, st_s = timed(st.encode, texts, batch_size=args.st_batch_size, convert_to_tensor=True)
    ours = torch.tensor([o.outputs.embedding for o in folio_out])
    cos = torch.nn.functional.cosine_similarity(ours, st_out.float(), dim=1)
    print(f"folio embed (s): {folio_s:.2f}")
    print(f"folio tokens per second: {num_tokens / folio_s:.0f}")
    print(f"sentence-transformers encode (s): {st_s:.2f}")
    print(f"sentence-transformers tokens per second: {num_tokens / st_s:.0f}")
    print(f"folio / sentence-transformers throughput: {st_s / folio_s:.2f} x")
    print(f"smallest cosine between the two: {float(cos.min()):.6f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
