"""The prefix cache with images: time to first token for an image + question asked cold, then the
same image and question again (a prefix hit through the image), on a 1B-shape random-weight LLaVA
(a Llama 3.2 1B-shape text model under a CLIP ViT-B/16 at 224 pixels: 196 placeholders an image)
on the CPU, offline (``folio.LLM``, prefix caching on, one request at a time).

Each round takes a new image (seeded noise: no hit from an earlier round), asks it cold, then asks
the same image and question warm; the time to first token is a one-token request's wall time. It
prints each round's cold and warm seconds, the blocks the warm prompt found cached, the images the
tower ran (a warm prompt whose image is cached whole runs no tower) and the median warm / cold.
Random weights: the speed of a checkpoint of this shape, not its answers.

    folio bench vision [--rounds 3] [--text-layers 16] [--quantization none|int8|int4] [--keep DIR]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

# Llama 3.2 1B's text shape and CLIP ViT-B/16's tower
TEXT_1B = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8)
VIT_B16 = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, projection_dim=512)
QUESTION = ("Describe everything you can see in this picture: the colours, the shapes, where each thing sits, "
            "and what the whole scene might be used for.")


def noise_image(seed: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (224, 224, 3), dtype=np.uint8))


def write_model(folder: Path, text_layers: int) -> str:
    from folio.core.model_files import prepare_default_model
    from folio.testing.models import write_tiny_llava_model

    tokenizer_dir = prepare_default_model(quiet=True)  # SmolLM2's tokenizer files
    return write_tiny_llava_model(folder, str(tokenizer_dir), image_size=224, patch_size=16,
                                  max_position_embeddings=2048, text_shape={**TEXT_1B, "num_hidden_layers": text_layers},
                                  vision_shape=VIT_B16, keep_init=True)


def ask(llm, image) -> tuple[float, int]:
    """(seconds to the first token, prompt tokens found cached) of one question about ``image``."""
    from folio import SamplingParams

    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                             {"type": "text", "text": QUESTION}]}]
    start = time.perf_counter()
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    return time.perf_counter() - start, out.num_cached_tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="folio bench vision", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--text-layers", type=int, default=16)
    ap.add_argument("--quantization", default="none", choices=("none", "int8", "int4"))
    ap.add_argument("--keep", default=None, help="write the model in this folder, or reuse the one there")
    args = ap.parse_args(argv)
    from folio import LLM

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep or tmp) / "llava-1b-shape"
        if not (folder / "config.json").exists():
            start = time.perf_counter()
            write_model(folder, args.text_layers)
            print(f"wrote {folder} in {time.perf_counter() - start:.0f} s")
        llm = LLM(str(folder), dtype="float32", quantization=args.quantization, enable_prefix_caching=True,
                  max_num_seqs=4)
        encoder = llm.engine.core.runner.image_inputs
        ask(llm, noise_image(10_000))  # kernels, allocator and caches warm
        colds, warms = [], []
        for r in range(args.rounds):
            image = noise_image(r)
            cold, cold_hit = ask(llm, image)
            encoded = encoder.num_encoded
            warm, warm_hit = ask(llm, image)
            print(f"round {r}: cold {cold:.3f} s ({cold_hit} tokens cached), warm {warm:.3f} s ({warm_hit} tokens "
                  f"cached, {encoder.num_encoded - encoded} images through the tower)", flush=True)
            colds.append(cold)
            warms.append(warm)
    cold, warm = statistics.median(colds), statistics.median(warms)
    print(f"model: LLaVA, {args.text_layers} Llama 3.2 1B-shape layers, CLIP ViT-B/16 at 224 px (196 placeholders), "
          f"random weights, quantization {args.quantization}")
    print(f"cold time to first token (s, median): {cold:.3f}")
    print(f"warm time to first token (s, median): {warm:.3f}")
    print(f"warm / cold: {warm / cold:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
