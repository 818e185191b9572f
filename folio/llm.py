"""``folio.LLM``: the offline API, vLLM's shape.

    from folio import LLM, SamplingParams
    llm = LLM(model="SmolLM2-135M-Instruct", num_kv_blocks=512)
    for out in llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8)):
        print(out.outputs[0].text)

With ``task="embed"`` (or ``"generate,embed"`` for both) it pools instead: ``embed`` returns each
input's last-token embedding, L2-normalised, and ``score`` a yes/no reranker's p(yes) of (query,
document) pairs, through the same scheduler as generation (prefill only, prefix cache shared).

It runs the services' scheduler, allocator replica (prefix cache included), model runner and
tokenizer code in this process, without sockets (``engine.LLMEngine``), so that a prompt gets the
tokens and text that ``folio serve`` would return for it. ``generate`` and ``chat`` queue every
prompt at once and step the engine until all are done, with a progress bar.
"""

from __future__ import annotations

import array
import dataclasses
import itertools
import json
import time

import msgspec

from folio.core.engine import EngineCore, LLMEngine
from folio.outputs import EmbeddingOutput, PoolingRequestOutput, RequestBuilder, RequestOutput, ScoringOutput
from folio.core.input_processor import RerankFormat, decode_data_url, embed_params, generate_request, read_chat
from folio.shared.config import DEFAULT_MODEL_NAME, POOLING_TASKS, RuntimeConfig, SchedulerConfig, parse_tasks
from folio.shared.sampling import SamplingParams

# engine arguments: the config fields ``folio serve``'s flags set, by the flag's name with underscores
_RUNTIME_ARGS = {f.name for f in dataclasses.fields(RuntimeConfig)} - {"model"}
_SCHEDULER_ARGS = {f.name for f in dataclasses.fields(SchedulerConfig)} - {"endpoints", "log_json"}
_ALIASES = {f.metadata["flag"].dest: f.name for f in dataclasses.fields(RuntimeConfig)
            if "flag" in f.metadata and f.metadata["flag"].name}  # --kv-cache-memory-bytes sets kv_cache_bytes
_LORA_ARGS = {"enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "lora_modules"}  # the runner's
_SPEC_ARGS = {"speculative_model", "speculative_config"}
_ENGINE_ARGS = _RUNTIME_ARGS | _SCHEDULER_ARGS | {"enable_prefix_caching"} | set(_ALIASES) | _LORA_ARGS


def engine_configs(model: str, options: dict) -> tuple[RuntimeConfig, dict]:
    """(the runtime's config, ``EngineCore``'s keyword arguments) from ``LLM``'s engine arguments."""
    unknown = sorted(set(options) - _ENGINE_ARGS)
    if unknown:
        raise TypeError(f"unknown engine argument(s) {', '.join(unknown)}; known: {', '.join(sorted(_ENGINE_ARGS))}")
    options = {_ALIASES.get(k, k): v for k, v in options.items()}
    if isinstance(options.get("speculative_config"), dict):  # vLLM's form; the flag's is its JSON text
        options["speculative_config"] = json.dumps(options["speculative_config"])
    runtime = RuntimeConfig(model=model, **{k: v for k, v in options.items()
                                            if k in _RUNTIME_ARGS and k not in _LORA_ARGS})
    if getattr(runtime, "tensor_parallel_size", 1) != 1:
        raise ValueError("the offline API runs the model in this one process: tensor_parallel_size must be 1 "
                         "(folio serve -tp N splits it over N processes)")
    # the scheduler learns that steps carry drafts from the runner (``EngineCore``), not from these
    core = {k: v for k, v in options.items()
            if (k in _SCHEDULER_ARGS and k not in _LORA_ARGS | _SPEC_ARGS) or k == "enable_prefix_caching"}
    core["max_num_seqs"], core["max_num_batched_tokens"] = runtime.max_num_seqs, runtime.max_num_batched_tokens
    return runtime, core


class LLM:
    """A model and its engine in this process. ``engine_args``: ``folio serve``'s flags with
    underscores (``num_kv_blocks``, ``max_num_seqs``, ``dtype``, ``enable_prefix_caching``,
    ``preemption_mode``, ...); ``enable_lora=True`` (with ``max_loras``, ``max_lora_rank``,
    ``max_cpu_loras``) serves LoRA adapters that ``generate``'s ``lora_request`` names;
    ``speculative_config={"method": "suffix"}`` (a dict or its JSON) drafts tokens to verify."""

    def __init__(self, model: str = DEFAULT_MODEL_NAME, task: str = "generate",
                 rerank_format: RerankFormat | None = None, **engine_args):
        """``task``: ``generate``, ``embed`` (``score``, ``rerank``: the same pooling engine) or a
        comma-separated list; ``rerank_format``: how ``score`` prompts a reranker (Qwen3-Reranker's)."""
        from folio.core.model_files import encoder_only_refusal, resolve_model
        from folio.core.executor.runtime.runner import ModelRunner
        from folio.core.tokenizer.text import TextTokenizer

        lora_args = {k: engine_args.pop(k) for k in _LORA_ARGS & set(engine_args)}
        runtime, core_args = engine_configs(model, engine_args)
        model_path = str(resolve_model(model))
        refusal = encoder_only_refusal(model_path, parse_tasks(task))
        if refusal:
            raise ValueError(refusal)
        runner = ModelRunner(runtime, model_path, **lora_args)
        core = EngineCore(runner, **core_args)
        self.engine = LLMEngine(core, TextTokenizer(model_path, core.max_model_len))
        self._ids = itertools.count()
        self.tasks = set(parse_tasks(task).split(","))
        self.rerank_format = rerank_format or RerankFormat()

    def get_tokenizer(self):
        """The Hugging Face tokenizer (``encode``, ``decode``, ``apply_chat_template``)."""
        return self.engine.tokenizer.hf

    def stats(self) -> dict:
        """The scheduler's statistics since this LLM started: steps, tokens, preemptions, forks,
        prefix-cache hits (``num_cached_tokens_total``, ``prefix_cache_hit_rate``), free blocks."""
        return self.engine.core.stats()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request=None) -> list[RequestOutput]:
        """Complete each prompt: a string, a list of token ids, or a dict with ``prompt`` or
        ``prompt_token_ids``; a list of those; one RequestOutput per prompt, in order.
        ``lora_request``: a ``LoRARequest`` for every prompt, or a list of them (None entries:
        the base model) one per prompt."""
        self._need_generation()
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        fields = [_prompt_fields(p) for p in prompts]
        for f, name in zip(fields, self._lora_names(lora_request, len(fields))):
            if name is not None:
                f["lora_name"] = name
        return self._run(fields, sampling_params, use_tqdm)

    def embed(self, inputs, dimensions: int | None = None, use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """Each input's embedding (a string, a list of token ids, or a list of those): the final hidden
        state at its last token, its first ``dimensions`` values (all by default), L2-normalised."""
        self._need_pooling("embed")
        if isinstance(inputs, (str, dict)) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        empty = [i for i, p in enumerate(inputs) if not p]
        if empty:  # as /v1/embeddings: nothing to embed (a tokenizer that appends EOS would embed that alone)
            raise ValueError(f"input {empty[0]} is empty")
        outs = self._run([_prompt_fields(p) for p in inputs], embed_params(dimensions), use_tqdm)
        return [PoolingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(_floats(o.pooled)),
                                     num_cached_tokens=o.num_cached_tokens) for o in outs]

    def score(self, query, documents, use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """A yes/no reranker's p(yes) for each document against ``query`` (one string, or one per
        document), with the prompt format of ``rerank_format``."""
        self._need_pooling("score")
        documents = [documents] if isinstance(documents, str) else list(documents)
        queries = [query] * len(documents) if isinstance(query, str) else list(query)
        if len(queries) != len(documents):
            raise ValueError(f"{len(queries)} queries for {len(documents)} documents")
        fmt = self.rerank_format
        fields = [{"prompt": fmt.prompt(q, d), "add_special_tokens": False} for q, d in zip(queries, documents)]
        outs = self._run(fields, fmt.params(), use_tqdm)
        return [PoolingRequestOutput(o.request_id, o.prompt_token_ids, ScoringOutput(fmt.score(_floats(o.pooled))),
                                     num_cached_tokens=o.num_cached_tokens) for o in outs]

    def _need_pooling(self, what: str) -> None:
        if not self.tasks & set(POOLING_TASKS):
            raise ValueError(f"{what} needs a pooling engine: LLM(..., task='embed') (or 'generate,embed')")

    def _need_generation(self) -> None:
        if "generate" not in self.tasks:
            raise ValueError(f"this LLM pools (task={','.join(sorted(self.tasks))!r}): generating needs "
                             "task='generate' (or 'generate,embed')")

    def _lora_names(self, lora_request, num_prompts: int) -> list[str | None]:
        """Each prompt's adapter name; an adapter not registered yet is read now (a bad one raises
        ``LoRAError``, a ValueError, before any prompt is queued)."""
        requests = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * num_prompts
        if len(requests) != num_prompts:
            raise ValueError(f"{len(requests)} LoRA requests for {num_prompts} prompts")
        runner = self.engine.core.runner
        for req in {r.lora_name: r for r in requests if r is not None}.values():
            if req.lora_name not in runner.lora_names():
                runner.add_lora(req.lora_name, req.lora_path)
        return [r.lora_name if r is not None else None for r in requests]

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, tools: list[dict] | None = None,
             lora_request=None, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Reply to a conversation (a list of ``{"role", "content"}`` messages) or to each of a
        list of conversations, through the model's chat template, as ``/v1/chat/completions`` does.
        ``chat_template_kwargs``: extra template variables (Qwen3's ``enable_thinking``).
        Images (a vision-language model): content parts ``{"type": "image_url", "image_url": {"url":
        "data:image/png;base64,..."}}`` as OpenAI's, or ``{"type": "image_pil", "image_pil": image}``
        with a PIL image."""
        self._need_generation()
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        fields = []
        for c in conversations:
            chat, urls = read_chat(_pil_parts_as_urls(c))
            fields.append({"messages": chat, "add_generation_prompt": add_generation_prompt, "tools": tools,
                           "chat_template_kwargs": chat_template_kwargs, "images": _url_images(urls)})
        for f, name in zip(fields, self._lora_names(lora_request, len(fields))):
            if name is not None:
                f["lora_name"] = name
        return self._run(fields, sampling_params, use_tqdm)

    def _run(self, prompts: list[dict], params, use_tqdm: bool) -> list[RequestOutput | RequestBuilder]:
        """Every prompt to the end: RequestOutputs, or for pooling params the builders (``pooled``)."""
        params = params if params is not None else SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        builders = self._add_all(prompts, params)
        by_seq = {seq_id: b for b in builders for seq_id in b.index}
        try:
            self._step_until_done(builders, by_seq, use_tqdm)
        except BaseException:
            for seq_id in by_seq:
                self.engine.abort(seq_id)
            raise
        while self.engine.has_work() and self.engine.step() is not None:
            pass  # the finished requests' blocks go back (and to the prefix cache) now
        errors = [e for b in builders for e in b.errors]
        if errors:
            raise RuntimeError(f"the engine failed a request: {errors[0]}")
        if all(p.pools for p in params):
            return builders
        return [b.build() for b in builders]

    def _add_all(self, prompts: list[dict], params: list[SamplingParams]) -> list[RequestBuilder]:
        """Queue every prompt; a prompt that cannot run raises ValueError and queues nothing."""
        from folio.core.tokenizer.text import RequestError

        builders: list[RequestBuilder] = []
        for i, (fields, sp) in enumerate(zip(prompts, params)):
            request_id = str(next(self._ids))
            req = msgspec.structs.replace(generate_request(sp, request_id, **fields), arrival_time=time.time())
            try:
                prompt_token_ids, prompt_text, refusals = self.engine.add_request(req)
            except RequestError as exc:
                refusals = [exc]
            else:
                builders.append(RequestBuilder(request_id, [req.req_id, *req.fork_req_ids], prompt_text,
                                               prompt_token_ids, sp.n, sp.logprobs is not None))
            if refusals:
                for seq_id in (seq_id for b in builders for seq_id in b.index):
                    self.engine.abort(seq_id)
                error = refusals[0] if isinstance(refusals[0], RequestError) else refusals[0].error
                raise ValueError(f"prompt {i}: {error}")
        return builders

    def _step_until_done(self, builders: list[RequestBuilder], by_seq: dict[str, RequestBuilder],
                         use_tqdm: bool) -> None:
        from tqdm.auto import tqdm

        num_unfinished = len(builders)
        num_output_tokens = 0
        start = time.perf_counter()
        with tqdm(total=len(builders), desc="Processed prompts", unit="prompt", disable=not use_tqdm) as bar:
            while num_unfinished:
                deltas = self.engine.step()
                if deltas is None:
                    raise RuntimeError("the engine has unfinished requests but nothing to schedule")
                for delta in deltas:
                    builder = by_seq.get(delta.req_id)
                    if builder is None:
                        continue
                    was_finished = builder.finished
                    builder.add(delta)
                    num_output_tokens += len(delta.token_ids)
                    if builder.finished and not was_finished:
                        num_unfinished -= 1
                        bar.update(1)
                        bar.set_postfix_str(f"output: {num_output_tokens / (time.perf_counter() - start):.1f} tok/s")


def _floats(data: bytes) -> list[float]:
    values = array.array("f")
    values.frombytes(data)  # little-endian float32, as the executor packed it
    return values.tolist()


def _image_file(image) -> bytes:
    """A PIL image as a PNG file (lossless: the processor sees the same pixels), or a data URL's file."""
    if isinstance(image, str):
        return _url_images([image])[0]
    if isinstance(image, bytes):
        return image
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _url_images(urls: list[str]) -> list[bytes]:
    out = []
    for i, url in enumerate(urls):
        if not url.startswith("data:"):
            raise ValueError(f"image {i}: folio.LLM takes images as PIL images or data URLs, not {url[:40]!r}")
        out.append(decode_data_url(url, 1 << 62, i))
    return out


def _pil_parts_as_urls(conversation: list[dict]) -> list[dict]:
    """``image_pil`` parts (a PIL image) as ``image_url`` parts with a PNG data URL."""
    import base64

    out = []
    for m in conversation:
        content = m.get("content")
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image_pil" for p in content):
            parts = []
            for p in content:
                if isinstance(p, dict) and p.get("type") == "image_pil":
                    url = "data:image/png;base64," + base64.b64encode(_image_file(p["image_pil"])).decode()
                    p = {"type": "image_url", "image_url": {"url": url}}
                parts.append(p)
            m = {**m, "content": parts}
        out.append(m)
    return out


def _prompt_fields(prompt) -> dict:
    """A prompt as the GenerateRequest fields that carry it."""
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return {"prompt_token_ids": list(prompt["prompt_token_ids"])}
        if "prompt" in prompt:
            images = (prompt.get("multi_modal_data") or {}).get("image")
            if images is None:
                return {"prompt": prompt["prompt"]}
            images = images if isinstance(images, (list, tuple)) else [images]
            return {"prompt": prompt["prompt"], "images": [_image_file(im) for im in images]}
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        return {"prompt_token_ids": list(prompt)}
    raise ValueError(f"a prompt is a string, a list of token ids or a dict, not {type(prompt).__name__}")
