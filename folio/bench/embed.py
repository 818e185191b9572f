"""Embeddings throughput on the CPU: ``folio.LLM(task="embed").embed`` against sentence-transformers'
``encode`` on the same model and the same texts, in one run, with the same pooling (last token,
L2-normalised) and fp32 weights on both sides.

The texts are ``--num-inputs`` spans of a fixed word list, ``--min-tokens`` to ``--max-tokens``
tokens each (uniform, seeded). Each side embeds a few texts first (kernels, allocator and caches
warm), then all of them once, timed; the embeddings are compared (the smallest cosine printed), so
a fast wrong answer shows. sentence-transformers batches by length (``--st-batch-size``) with
padding; folio schedules the inputs through its paged prefill under ``--max-num-batched-tokens``,
on its C kernels by default (``--attention-backend cpu``: the whole layer stack in one call; ``torch``
is the reference backend, about half as fast here). ``--threads`` sets torch's threads for both
(default: torch's own choice).

    folio bench embed [--model PATH] [--num-inputs 256] [--min-tokens 64] [--max-tokens 512]
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
    """The same checkpoint as a SentenceTransformer: its transformer, last-token pooling, normalised."""
    from sentence_transformers import SentenceTransformer, models

    # plain text in (sentence-transformers would otherwise wrap each text in the chat template)
    body = models.Transformer(path, model_kwargs={"dtype": torch.float32}, module_output_name="token_embeddings",
                              modality_config={"text": {"method": "forward", "method_output_name": "last_hidden_state"}})
    pooling = models.Pooling(body.get_embedding_dimension(), pooling_mode="lasttoken")
    return SentenceTransformer(modules=[body, pooling, models.Normalize()], device="cpu")


def timed(fn, *args, **kw) -> tuple[object, float]:
    start = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - start


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
    args = ap.parse_args(argv)
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
