"""Tiny random-weight checkpoints written to disk."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch


def write_tiny_model(path, model_type: str = "llama", base_model: bool = False, **overrides) -> str:
    """A random-weight checkpoint in ``path`` (config.json + safetensors) of any ``model_type``
    transformers knows (its config class's defaults, then these sizes, then ``overrides``);
    ``base_model``: the decoder without its LM head (``Qwen3Model``), as embedding models are saved."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    base = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    base.update(overrides)
    config = AutoConfig.for_model(model_type, **base)
    torch.manual_seed(0)
    model = (AutoModel if base_model else AutoModelForCausalLM).from_config(config, dtype=torch.float32)
    return save_random(model, path)


def save_random(model, path) -> str:
    """``model`` with larger weights than the init (logits far from uniform, paths differ), saved."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or p.dim() > 1:
                p.normal_(0.0, 0.2)
            else:  # norm weights
                p.normal_(1.0, 0.1)
    model.save_pretrained(path)
    return str(path)


def write_tiny_chat_model(folder, tokenizer_dir, max_position_embeddings: int = 256) -> str:
    """A tiny random Llama with a real tokenizer (SmolLM2's), so that the tokenizer service runs."""
    write_tiny_model(folder, vocab_size=49152, max_position_embeddings=max_position_embeddings)
    for f in Path(tokenizer_dir).iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, Path(folder) / f.name)
    return str(folder)


# Qwen3's chat format, cut to what the tests use: tools in the system turn, <tool_call> JSON in
# assistant turns, tool results as <tool_response>, and enable_thinking=false closing an empty
# think block in the prompt
QWEN3_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n"
    "{% endif %}# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}{% if m.role == 'system' and loop.first %}"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}{% for c in m.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def write_tiny_qwen3_chat_model(folder, tokenizer_dir, max_position_embeddings: int = 512) -> str:
    """A tiny random Qwen3 that speaks Qwen3's chat format: SmolLM2's tokenizer with Qwen3's
    ``<think>`` and ``<tool_call>`` tokens added and ``QWEN3_TEMPLATE``."""
    vocab_size = write_qwen3_tokenizer(folder, tokenizer_dir)
    write_tiny_model(folder, "qwen3", vocab_size=vocab_size + 4, head_dim=16,
                     max_position_embeddings=max_position_embeddings)
    return str(folder)


def write_qwen3_tokenizer(folder, tokenizer_dir) -> int:
    """The tokenizer of ``write_tiny_qwen3_chat_model`` alone, in ``folder``; its vocabulary size."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"])
    tokenizer.chat_template = QWEN3_TEMPLATE
    tokenizer.save_pretrained(folder)
    return len(tokenizer)


def write_tiny_embedding_model(folder, tokenizer_dir, max_position_embeddings: int = 512) -> str:
    """A tiny random decoder embedding model of Qwen3-Embedding's shape: a Qwen3 base model saved
    without an LM head, and a tokenizer (SmolLM2's) that appends ``<|endoftext|>`` to every text as
    Qwen3-Embedding's does: the last token, whose final hidden state is the embedding."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", pair="$A <|endoftext|> $B <|endoftext|>", special_tokens=[("<|endoftext|>", eos)])
    tokenizer.save_pretrained(folder)
    write_tiny_model(folder, "qwen3", base_model=True, vocab_size=len(tokenizer), head_dim=16,
                     max_position_embeddings=max_position_embeddings)
    return str(folder)


# a small WordPiece vocabulary: BERT's special tokens, letters and digits (whole and as "##"
# continuations, so any lower-case ASCII word tokenizes), punctuation and a few whole words
BERT_WORDS = ("the", "a", "of", "and", "to", "in", "is", "cat", "dog", "sat", "on", "mat", "hello", "world",
              "embedding", "model", "##s", "##ing", "##ed")


def write_bert_vocab(path) -> Path:
    chars = "abcdefghijklmnopqrstuvwxyz0123456789"
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *(f"##{c}" for c in chars),
              *".,;:!?'\"()-", *BERT_WORDS]
    path = Path(path)
    path.write_text("\n".join(dict.fromkeys(tokens)) + "\n")
    return path


def write_tiny_bert_embedding_model(folder, pooling: str = "mean", normalize: bool = True,
                                    max_position_embeddings: int = 64, hidden_size: int = 64,
                                    num_hidden_layers: int = 2) -> str:
    """A tiny random BERT embedding model as sentence-transformers saves one (all-MiniLM-L6-v2's
    shape): a ``BertModel`` from transformers' ``BertConfig``, a WordPiece ``BertTokenizerFast``
    over ``write_bert_vocab``'s vocabulary, and the sentence-transformers modules (Transformer,
    Pooling by ``pooling``: mean or cls, and Normalize when ``normalize``), written by
    sentence-transformers' own ``save``."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_bert_vocab(folder / "vocab.txt")
    tokenizer = BertTokenizerFast(vocab=str(vocab), do_lower_case=True)
    tokenizer.model_max_length = max_position_embeddings
    tokenizer.save_pretrained(folder)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                        num_attention_heads=4, intermediate_size=2 * hidden_size,
                        max_position_embeddings=max_position_embeddings)
    torch.manual_seed(0)
    save_random(BertModel(config), folder)
    body = Transformer(str(folder), max_seq_length=max_position_embeddings)
    modules = [body, Pooling(hidden_size, pooling_mode=pooling)] + ([Normalize()] if normalize else [])
    SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    return str(folder)


# LLaVA-1.5's chat format ("USER: <image>\n... ASSISTANT:"), over messages whose content is a string
# or a list of parts ({"type": "image"} and {"type": "text", "text": ...}), as llava-hf's processors have it
LLAVA_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'system' %}{{ m.content }}\n{% else %}"
    "{{ m.role.upper() }}: {% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{% if p.type == 'image' %}<image>\n{% elif p.type == 'text' %}{{ p.text }}{% endif %}"
    "{% endfor %}{% endif %}{{ '\\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def write_tiny_llava_model(folder, tokenizer_dir, image_size: int = 30, patch_size: int = 6,
                           max_position_embeddings: int = 512, text_shape: dict | None = None,
                           vision_shape: dict | None = None, keep_init: bool = False) -> str:
    """A tiny random LLaVA (``LlavaForConditionalGeneration``: a CLIP vision tower, the two-layer
    projector and a Llama text model) with its processor (``LlavaProcessor``: a ``CLIPImageProcessor``
    at ``image_size`` and SmolLM2's tokenizer with ``<image>`` added), both written by transformers'
    own ``save_pretrained``. An image becomes ``(image_size / patch_size) ** 2`` placeholders (the
    CLS position is dropped, LLaVA's default feature selection). ``text_shape`` / ``vision_shape``:
    LlamaConfig / CLIPVisionConfig sizes in place of the tiny ones (``folio bench vision``'s 1B shape);
    ``keep_init``: transformers' own initialisation, not ``save_random``'s wider one (finite activations
    through a deep model)."""
    from transformers import (
        AutoTokenizer, CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
        LlavaForConditionalGeneration, LlavaProcessor,
    )

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_tokens(["<image>"], special_tokens=True)
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    image_processor = CLIPImageProcessor(size={"shortest_edge": image_size},
                                         crop_size={"height": image_size, "width": image_size})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch_size,
                               num_additional_image_tokens=1,  # the CLS position, as llava-hf checkpoints say
                               vision_feature_select_strategy="default", chat_template=LLAVA_TEMPLATE)
    processor.save_pretrained(folder)
    tokenizer.chat_template = LLAVA_TEMPLATE
    tokenizer.save_pretrained(folder)
    vision = CLIPVisionConfig(**{**dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                        projection_dim=32), **(vision_shape or {})},
                              image_size=image_size, patch_size=patch_size)
    text = LlamaConfig(**{**dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2), **(text_shape or {})},
                       vocab_size=len(tokenizer), max_position_embeddings=max_position_embeddings,
                       rms_norm_eps=1e-5, tie_word_embeddings=False,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=image_token_id,
                         vision_feature_layer=-2, vision_feature_select_strategy="default",
                         image_seq_length=(image_size // patch_size) ** 2)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).to(torch.float32)
    if keep_init:
        model.save_pretrained(folder)
        return str(folder)
    return save_random(model, folder)


# Idefics3's chat format ("<|im_start|>User:<image>...<end_of_utterance>\nAssistant:"), as
# HuggingFaceM4's Idefics3 and SmolVLM processors have it, over string or list-of-parts contents
IDEFICS3_TEMPLATE = (
    "<|im_start|>{% for m in messages %}{{ m.role | capitalize }}"
    "{% if m.content is string %}: {{ m.content }}{% else %}"
    "{% if m.content[0].type == 'image' %}:{% else %}: {% endif %}"
    "{% for p in m.content %}{% if p.type == 'image' %}<image>{% elif p.type == 'text' %}{{ p.text }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


def write_tiny_idefics3_model(folder, tokenizer_dir, image_size: int = 32, patch_size: int = 4, scale_factor: int = 2,
                              do_image_splitting: bool = False, max_position_embeddings: int = 1024) -> str:
    """A tiny random Idefics3 (``Idefics3ForConditionalGeneration``, SmolVLM's architecture: a
    SigLIP-style vision tower, the pixel-shuffle connector and a Llama text model) with its
    processor (``Idefics3Processor``: an ``Idefics3ImageProcessor`` whose tiles are ``image_size``
    squares, and SmolLM2's tokenizer with Idefics3's tokens added: ``<fake_token_around_image>``,
    ``<image>``, ``<end_of_utterance>``, ``<global-img>`` and ``<row_i_col_j>``), both written by
    transformers' own ``save_pretrained``. A tile becomes ``(image_size / patch_size / scale_factor) ** 2``
    placeholders; without ``do_image_splitting`` an image is one tile (resized to the square), with
    it an image larger than a tile is cut into tiles and followed by the whole image as one more."""
    from transformers import (
        AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil,
        Idefics3Processor, Idefics3VisionConfig, LlamaConfig,
    )

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    extra = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
    extra += [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    tokenizer.add_special_tokens({"additional_special_tokens": extra})
    image_seq_len = (image_size // patch_size // scale_factor) ** 2
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": 2 * image_size},
                                                max_image_size={"longest_edge": image_size},
                                                do_image_splitting=do_image_splitting)
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=image_seq_len,
                                  chat_template=IDEFICS3_TEMPLATE)
    processor.save_pretrained(folder)
    tokenizer.chat_template = IDEFICS3_TEMPLATE
    tokenizer.save_pretrained(folder)
    vision = Idefics3VisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                  image_size=image_size, patch_size=patch_size)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
                       rms_norm_eps=1e-5, tie_word_embeddings=False,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = Idefics3Config(vision_config=vision, text_config=text, scale_factor=scale_factor,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(config).to(torch.float32)
    return save_random(model, folder)


# Qwen2-VL's chat format ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>...<|im_end|>"),
# as Qwen2.5-VL's processors have it, over string or list-of-parts contents
QWEN2_VL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{% if p.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_qwen25_vl_model(folder, tokenizer_dir, patch_size: int = 4, merge_size: int = 2,
                               max_pixels: int = 48 * 48, tie_word_embeddings: bool = True,
                               max_position_embeddings: int = 1024, hidden_size: int = 64, num_attention_heads: int = 4,
                               num_key_value_heads: int = 2, mrope_section: tuple[int, int, int] = (2, 3, 3)) -> str:
    """A tiny random Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``: a windowed ViT over the
    image's own patch grid, its patch merger, and a Qwen2 text model rotated by M-RoPE) with its
    processor (``Qwen2_5_VLProcessor``: a ``Qwen2VLImageProcessor`` that keeps each image's aspect
    and resizes it to a multiple of ``patch_size * merge_size`` within ``max_pixels``, and
    SmolLM2's tokenizer with Qwen's ``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>``
    and ``<|video_pad|>`` added), written by transformers' own ``save_pretrained``. An image
    of ``h x w`` patches becomes ``h * w / merge_size ** 2`` placeholders: images of different
    sizes have different counts. ``mrope_section`` splits half of the head dimension
    (``hidden_size / num_attention_heads``) among the temporal, height and width positions."""
    from transformers import (
        AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor,
        Qwen2VLImageProcessorPil,
    )

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": [
        "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = QWEN2_VL_TEMPLATE
    sizes = dict(patch_size=patch_size, temporal_patch_size=2, merge_size=merge_size,
                 size={"shortest_edge": (patch_size * merge_size) ** 2, "longest_edge": max_pixels})
    # the processor as its save_pretrained writes it (processor_config.json beside the tokenizer),
    # less its video half, which cannot be built without torchvision (``vision_inputs.load_processor``
    # builds the processor without it)
    image_processor = Qwen2VLImageProcessorPil(**sizes).to_dict()
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / "processor_config.json").write_text(json.dumps(
        {"image_processor": image_processor, "processor_class": Qwen2_5_VLProcessor.__name__}, indent=2))
    tokenizer.save_pretrained(folder)
    ids = {name: tokenizer.convert_tokens_to_ids(f"<|{name}|>") for name in
           ("vision_start", "vision_end", "image_pad", "video_pad")}
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=hidden_size,
                  patch_size=patch_size, spatial_merge_size=merge_size, temporal_patch_size=2,
                  window_size=2 * patch_size * merge_size, fullatt_block_indexes=[1])
    text = dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
                max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-5,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": list(mrope_section)},
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = Qwen2_5_VLConfig(vision_config=vision, text_config=text, image_token_id=ids["image_pad"],
                              video_token_id=ids["video_pad"], vision_start_token_id=ids["vision_start"],
                              vision_end_token_id=ids["vision_end"], tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    return save_random(model, folder)


# Gemma 3's chat format ("<start_of_turn>user\n...<end_of_turn>\n<start_of_turn>model\n"), an image
# part written as ``<start_of_image>`` (which ``Gemma3Processor`` expands), over string or
# list-of-parts contents
GEMMA3_TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{% if p.type == 'image' %}<start_of_image>{% elif p.type == 'text' %}{{ p.text }}"
    "{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def write_tiny_gemma3_vlm_model(folder, tokenizer_dir, image_size: int = 32, patch_size: int = 4,
                                mm_tokens_per_image: int = 16, sliding_window: int = 8,
                                max_position_embeddings: int = 512, tie_word_embeddings: bool = True) -> str:
    """A tiny random Gemma 3 vision-language model (``Gemma3ForConditionalGeneration``: a SigLIP
    vision tower, Gemma 3's pooling projector and a Gemma 3 text model of one sliding-window layer
    and one global layer, embeddings tied to the head unless ``tie_word_embeddings`` is False) with
    its processor (``Gemma3Processor``: a ``Gemma3ImageProcessor`` at ``image_size`` and SmolLM2's
    tokenizer with Gemma 3's
    ``<start_of_image>``, ``<image_soft_token>``, ``<end_of_image>``, ``<start_of_turn>`` and
    ``<end_of_turn>`` added), both written by transformers' own ``save_pretrained``. An image
    becomes ``mm_tokens_per_image`` placeholders between ``<start_of_image>`` and ``<end_of_image>``;
    a ``sliding_window`` below that cuts an image's own placeholders out of its later ones' windows."""
    from transformers import (
        AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessor, Gemma3Processor,
        Gemma3TextConfig, SiglipVisionConfig,
    )

    special = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, extra_special_tokens=special)
    tokenizer.add_special_tokens({"additional_special_tokens": [*special.values(), "<start_of_turn>", "<end_of_turn>"]})
    tokenizer.chat_template = GEMMA3_TEMPLATE
    image_processor = Gemma3ImageProcessor(size={"height": image_size, "width": image_size})
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer, chat_template=GEMMA3_TEMPLATE,
                                image_seq_length=mm_tokens_per_image)
    processor.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                image_size=image_size, patch_size=patch_size)
    text = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                            sliding_window=sliding_window, layer_types=["sliding_attention", "full_attention"],
                            max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=tie_word_embeddings)
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in special.items()}
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=mm_tokens_per_image,
                          boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"],
                          image_token_index=ids["image_token"], tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).to(torch.float32)
    return save_random(model, folder)
