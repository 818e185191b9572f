"""Any OpenAI-compatible endpoint under load (folio, vLLM, llama.cpp's server, a router): vLLM's
``bench serve`` figures in vLLM's layout, so results compare line by line (``folio bench serve``).

    folio bench serve --base-url http://127.0.0.1:8000 [--model NAME] [--endpoint completions|chat]
        [--dataset random|prefix-repetition|sharegpt [--dataset-path FILE]] [--num-prompts 1000]
        [--request-rate inf|R [--burstiness 1.0]] [--max-concurrency N]
        [--input-len 1024 --output-len 128 --range-ratio 0.0] [--seed 0]
        [--goodput ttft:200 tpot:50] [--save-result FILE.json] [--plot FILE.png] [--preset NAME]

More in docs/modules.md (folio/bench/serve.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime

import numpy as np

from folio.bench.report import print_block, write_json

# the serving scripts' workloads, as `folio bench serve` flags (explicit flags override them)
PRESETS: dict[str, dict] = {
    "mixed": dict(dataset="random", input_len=88, output_len=44, range_ratio=0.8, num_prompts=64,
                  request_rate=math.inf),  # bench_serving.py: prompts 16..160, outputs 8..80, all at once
    "soak": dict(dataset="random", input_len=24, output_len=16, range_ratio=0.5, num_prompts=1200,
                 request_rate=20.0),  # bench_soak.py: Poisson arrivals at 20/s, max_tokens 16
    "prefix": dict(dataset="prefix-repetition", prefix_repetition_prefix_len=800, prefix_repetition_suffix_len=16,
                   prefix_repetition_num_prefixes=4, output_len=16, num_prompts=48, request_rate=math.inf,
                   max_concurrency=8),  # bench_router.py / bench_prefix_cache.py: long shared system prompts
    "streams": dict(dataset="random", input_len=8, output_len=64, range_ratio=0.0, num_prompts=512,
                    request_rate=math.inf, max_concurrency=512),  # bench_streams.py: many SSE streams
}

SLO_METRICS = ("ttft", "tpot", "e2el")
PERCENTILE_METRICS = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                      "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}

# common English words: most vocabularies keep " word" as one token; the tokenizer in use decides
WORDS = """the of and to in is was for on that with as by at from his her it an were are which this be
or has had not but one their they its first also new after who two been other when more time she there
all into year years some would than most over about world only can out up during school while people
city made under used well between both may later part where three many before state being then new found
however such through area same known work since became film war team called around including until them
each like life four high second back best several north south east west small large long last him any
day house main good great name end game group own family music history book water much old early based
even held season public series local power very began member general because right near place now left
river road park island field light sound land country home town village church law court market line
point case rate form lake house king queen army ship car train bridge hall garden tower station office
door wall floor table chair window paper letter story song voice color green blue red black white gold
stone wood iron glass fire wind rain snow cloud sun moon star sea sky hill valley forest tree flower
grass seed fruit apple bread milk egg fish bird horse dog cat cow sheep plan idea word page note list
test step turn move open close start stop keep help show hold bring tell read write speak hear feel
think know want need give take make find look come go run walk play sing talk live stay wait pay buy""".split()


@dataclass
class Prompt:
    text: str
    input_len: int | None  # tokens under the target's tokenizer; None when no tokenizer is known
    output_len: int


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    input_len: int | None = None  # the prompt's measured length, else the server's usage count
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds between successive chunks with text
    latency: float = 0.0
    start: float = 0.0  # perf_counter at the send
    text: str = ""


# ---------------------------------------------------------------- tokenizers


class HttpTokenizer:
    """The endpoint's own tokenizer over HTTP; ``style`` says which of the known APIs it speaks."""

    def __init__(self, session, root: str, style: str, model: str | None):
        self.session, self.root, self.style, self.model = session, root, style, model

    @classmethod
    async def probe(cls, session, root: str, model: str | None) -> "HttpTokenizer | None":
        for style in ("vllm", "llama.cpp", "llama-cpp-python"):
            tok = cls(session, root, style, model)
            try:
                if len(await tok.encode("hello world")) >= 1:
                    return tok
            except Exception:  # noqa: BLE001 - not this API
                continue
        return None

    async def encode(self, text: str) -> list[int]:
        if self.style == "vllm":
            url, body, key = "/tokenize", {"prompt": text, "add_special_tokens": False}, "tokens"
            if self.model:
                body["model"] = self.model
        elif self.style == "llama.cpp":
            url, body, key = "/tokenize", {"content": text, "add_special": False}, "tokens"
        else:
            url, body, key = "/extras/tokenize", {"input": text, "model": self.model or ""}, "tokens"
        async with self.session.post(self.root + url, json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{url}: HTTP {resp.status}")
            data = await resp.json(content_type=None)
        tokens = data[key]
        if not isinstance(tokens, list) or any(not isinstance(t, int) for t in tokens):
            raise RuntimeError(f"{url}: no token ids")
        return tokens

    def describe(self) -> str:
        return {"vllm": "the endpoint's /tokenize", "llama.cpp": "the endpoint's /tokenize (llama.cpp)",
                "llama-cpp-python": "the endpoint's /extras/tokenize"}[self.style]


class LocalTokenizer:
    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self.path = path
        self.tok = AutoTokenizer.from_pretrained(path)

    async def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def describe(self) -> str:
        return f"{self.path} (local)"


async def one_token_words(tok, words: list[str]) -> list[str]:
    """The words that ``tok`` keeps as one token with a leading space (the prompts' vocabulary)."""
    sem = asyncio.Semaphore(16)

    async def keep(word: str) -> bool:
        async with sem:
            return len(await tok.encode(" " + word)) == 1

    unique = sorted(set(words))
    kept = [w for w, ok in zip(unique, await asyncio.gather(*(keep(w) for w in unique))) if ok]
    return kept if len(kept) >= 16 else unique


async def fit_words(tok, rng: random.Random, pool: list[str], n: int, head: str = "") -> tuple[str, int | None]:
    """A text of ``n`` tokens under ``tok``: ``head`` (kept whole) then random words of ``pool``,
    words added or dropped until the count is exact (the closest after a few rounds)."""
    head_words = head.split()
    words = [rng.choice(pool) for _ in range(max(n - (await _count(tok, head) if head else 0), 1))]
    if tok is None:
        return " ".join(head_words + words), None
    best = None
    for _ in range(8):
        text = " ".join(head_words + words)
        got = len(await tok.encode(text))
        if best is None or abs(got - n) < abs(best[1] - n):
            best = (text, got)
        if got == n:
            break
        if got > n:
            words = words[:max(len(words) - (got - n), 1)]
        else:
            words += [rng.choice(pool) for _ in range(n - got)]
    return best


async def _count(tok, text: str) -> int:
    return len(await tok.encode(text)) if tok is not None else len(text.split())


# ---------------------------------------------------------------- datasets


def sample_lens(rng: random.Random, n: int, length: int, ratio: float) -> list[int]:
    """vLLM's ``--random-range-ratio``: uniform integers in [L(1-r), L(1+r)], at least 1."""
    low, high = int(length * (1 - ratio)), int(length * (1 + ratio))
    return [max(1, rng.randint(low, high)) for _ in range(n)]


async def build_prompts(args, tok) -> list[Prompt]:
    rng = random.Random(args.seed)
    pool = await one_token_words(tok, WORDS) if tok is not None else sorted(set(WORDS))
    n = args.num_prompts
    if args.dataset == "random":
        ins, outs = sample_lens(rng, n, args.input_len, args.range_ratio), sample_lens(rng, n, args.output_len,
                                                                                        args.range_ratio)
        texts = await _gather_limited([fit_words(tok, random.Random(f"{args.seed}-{i}"), pool, ins[i])
                                       for i in range(n)])
        return [Prompt(text, got, out) for (text, got), out in zip(texts, outs)]
    if args.dataset == "prefix-repetition":
        plen, slen = args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len
        prefixes = [(await fit_words(tok, rng, pool, plen))[0] for _ in range(args.prefix_repetition_num_prefixes)]
        out_len = args.prefix_repetition_output_len or args.output_len
        jobs = [fit_words(tok, random.Random(f"{args.seed}-{i}"), pool, plen + slen, head=prefixes[i % len(prefixes)])
                for i in range(n)]
        texts = await _gather_limited(jobs)
        prompts = [Prompt(text, got, out_len) for text, got in texts]
        rng.shuffle(prompts)
        return prompts
    return await sharegpt_prompts(args, tok, rng)


async def sharegpt_prompts(args, tok, rng: random.Random) -> list[Prompt]:
    """vLLM's ShareGPT sampling: each conversation's first turn is the prompt, the second's length
    the output length (``--output-len`` given explicitly overrides it); pairs with fewer than 4
    tokens on either side, a prompt over 1,024 or a total over 2,048 are left out."""
    if not args.dataset_path:
        raise SystemExit("folio bench serve: --dataset sharegpt needs --dataset-path FILE (ShareGPT JSON)")
    try:
        with open(args.dataset_path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"folio bench serve: {args.dataset_path}: {exc}") from None
    pairs = [(c["conversations"][0]["value"], c["conversations"][1]["value"]) for c in data
             if isinstance(c, dict) and len(c.get("conversations") or []) >= 2]
    rng.shuffle(pairs)
    prompts: list[Prompt] = []
    for prompt, completion in pairs:
        if len(prompts) == args.num_prompts:
            break
        plen = await _count(tok, prompt)
        olen = args.output_len if args.output_len_given else await _count(tok, completion)
        if plen < 4 or olen < 4 or plen > 1024 or plen + olen > 2048:
            continue
        prompts.append(Prompt(prompt, plen if tok is not None else None, olen))
    if len(prompts) < args.num_prompts:
        raise SystemExit(f"folio bench serve: {args.dataset_path} holds only {len(prompts)} usable conversations "
                         f"(--num-prompts {args.num_prompts})")
    return prompts


async def _gather_limited(coros, limit: int = 16):
    sem = asyncio.Semaphore(limit)

    async def run(c):
        async with sem:
            return await c

    return await asyncio.gather(*(run(c) for c in coros))


# ---------------------------------------------------------------- requests


def request_body(args, prompt: Prompt, ignore_eos: bool) -> dict:
    body = {"model": args.model, "max_tokens": prompt.output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt.text}]
    else:
        body["prompt"] = prompt.text
    return body


async def send(session, args, prompt: Prompt, ignore_eos: bool) -> RequestResult:
    import aiohttp

    url = args.root + ("/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions")
    res = RequestResult(input_len=prompt.input_len)
    res.start = last = time.perf_counter()
    chunks = 0
    usage = None
    try:
        async with session.post(url, json=request_body(args, prompt, ignore_eos), headers=args.headers) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return res
            done = False
            async for raw in resp.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    res.error = f"error event: {json.dumps(event['error'])[:300]}"
                    return res
                now = time.perf_counter()
                for choice in event.get("choices") or []:
                    chat = args.endpoint == "chat"
                    piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if piece:
                        if chunks == 0:
                            res.ttft = now - res.start
                        else:
                            res.itl.append(now - last)
                        last = now
                        chunks += 1
                        res.text += piece
                if event.get("usage"):
                    usage = event["usage"]
            if not done:
                res.error = "the stream ended without [DONE]"
                return res
    except asyncio.TimeoutError:
        res.error = f"no answer within {args.request_timeout:g}s"
        return res
    except (aiohttp.ClientError, ValueError, OSError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.latency = time.perf_counter() - res.start
    if chunks == 0:
        res.error = "no output tokens"
        return res
    res.output_tokens = int(usage["completion_tokens"]) if usage and usage.get("completion_tokens") else chunks
    if res.input_len is None and usage and usage.get("prompt_tokens"):
        res.input_len = int(usage["prompt_tokens"])
    res.success = True
    return res


async def arrivals(n: int, rate: float, burstiness: float, rng: random.Random):
    """Yield 0..n-1 at Poisson (gamma, for burstiness != 1) arrival times; all at once for inf."""
    for i in range(n):
        yield i
        if math.isinf(rate) or i == n - 1:
            continue
        await asyncio.sleep(rng.gammavariate(burstiness, 1.0 / (rate * burstiness)))


# ---------------------------------------------------------------- metrics


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``ttft:200 tpot:50`` -> {"ttft": 200.0, ...} (ms); a clear error for anything else."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput takes NAME:MS with NAME one of {', '.join(SLO_METRICS)}, not '{item}'")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item}: '{value}' is not a number of milliseconds") from None
        if slos[name] < 0:
            raise ValueError(f"--goodput {item}: the SLO must not be negative")
    return slos


def compute_metrics(results: list[RequestResult], duration: float, slos: dict[str, float],
                    percentiles: list[float]) -> dict:
    """vLLM's figures of one run (times in ms in the result, rates per second of ``duration``)."""
    ok = [r for r in results if r.success]
    ttfts = [r.ttft * 1000 for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) * 1000 for r in ok if r.output_tokens > 1]
    itls = [x * 1000 for r in ok for x in r.itl]
    e2els = [r.latency * 1000 for r in ok]
    total_in = sum(r.input_len or 0 for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    good = 0
    for r in ok:
        tpot = (r.latency - r.ttft) / (r.output_tokens - 1) * 1000 if r.output_tokens > 1 else 0.0
        got = {"ttft": r.ttft * 1000, "tpot": tpot, "e2el": r.latency * 1000}
        good += all(got[k] <= v for k, v in slos.items())
    peak_tokens, peak_conc, per_second = peak_rates(ok)
    m = {"completed": len(ok), "failed": len(results) - len(ok), "duration": duration,
         "total_input_tokens": total_in, "total_output_tokens": total_out,
         "request_throughput": len(ok) / duration if duration > 0 else 0.0,
         "request_goodput": good / duration if slos and duration > 0 else None,
         "output_throughput": total_out / duration if duration > 0 else 0.0,
         "max_output_tokens_per_s": peak_tokens, "max_concurrent_requests": peak_conc,
         "total_token_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
         "output_tokens_per_second_series": per_second}
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        arr = np.asarray(values or [0.0], dtype=float)
        m[f"mean_{name}_ms"] = float(arr.mean())
        m[f"median_{name}_ms"] = float(np.median(arr))
        m[f"std_{name}_ms"] = float(arr.std())
        for p in percentiles:
            m[f"p{_pword(p)}_{name}_ms"] = float(np.percentile(arr, p))
    return m


def peak_rates(ok: list[RequestResult]) -> tuple[float, int, list[float]]:
    """Output tokens and requests in flight per 1-second bucket from the first send: the peaks,
    and the tokens of each second (a chunk holds output_tokens / chunks tokens)."""
    if not ok:
        return 0.0, 0, []
    t0 = min(r.start for r in ok)
    end = max(r.start + r.latency for r in ok)
    seconds = int(math.ceil(end - t0)) + 1
    tokens, running = np.zeros(seconds), np.zeros(seconds, dtype=int)
    for r in ok:
        times = [r.start + r.ttft]
        for gap in r.itl:
            times.append(times[-1] + gap)
        weight = r.output_tokens / len(times)
        for t in times:
            tokens[int(t - t0)] += weight
        running[int(r.start - t0):int(r.start + r.latency - t0) + 1] += 1
    return float(tokens.max()), int(running.max()), [float(x) for x in tokens]


def _pword(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def result_rows(m: dict, args) -> list:
    rows = [("Successful requests:", m["completed"]), ("Failed requests:", m["failed"])]
    if args.max_concurrency:
        rows.append(("Maximum request concurrency:", args.max_concurrency))
    if not math.isinf(args.request_rate):
        rows.append(("Request rate configured (RPS):", float(args.request_rate)))
    rows += [("Benchmark duration (s):", m["duration"]),
             ("Total input tokens:", m["total_input_tokens"]),
             ("Total generated tokens:", m["total_output_tokens"]),
             ("Request throughput (req/s):", m["request_throughput"])]
    if m["request_goodput"] is not None:
        rows.append(("Request goodput (req/s):", m["request_goodput"]))
    rows += [("Output token throughput (tok/s):", m["output_throughput"]),
             ("Peak output token throughput (tok/s):", m["max_output_tokens_per_s"]),
             ("Peak concurrent requests:", m["max_concurrent_requests"]),
             ("Total Token throughput (tok/s):", m["total_token_throughput"])]
    for name in args.percentile_metrics:
        label = name.upper()
        rows.append((None, PERCENTILE_METRICS[name]))
        rows.append((f"Mean {label} (ms):", m[f"mean_{name}_ms"]))
        rows.append((f"Median {label} (ms):", m[f"median_{name}_ms"]))
        for p in args.metric_percentiles:
            rows.append((f"P{_pword(p)} {label} (ms):", m[f"p{_pword(p)}_{name}_ms"]))
    return rows


def plot(path: str, m: dict, results: list[RequestResult], percentiles: list[float]) -> None:
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise SystemExit("folio bench serve: --plot needs matplotlib (pip install 'folio[bench]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.success]
    series = {"TTFT": [r.ttft * 1000 for r in ok],
              "TPOT": [(r.latency - r.ttft) / (r.output_tokens - 1) * 1000 for r in ok if r.output_tokens > 1],
              "ITL": [x * 1000 for r in ok for x in r.itl], "E2EL": [r.latency * 1000 for r in ok]}
    shown = sorted({50.0, 90.0, *percentiles})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(shown)
    for j, p in enumerate(shown):
        values = [float(np.percentile(v, p)) if v else 0.0 for v in series.values()]
        ax1.bar([i + j * width for i in range(len(series))], values, width, label=f"p{_pword(p)}")
    ax1.set_xticks([i + width * (len(shown) - 1) / 2 for i in range(len(series))], list(series))
    ax1.set_ylabel("ms")
    ax1.set_yscale("log")
    ax1.set_title("Latency percentiles")
    ax1.legend()
    tokens = m["output_tokens_per_second_series"]
    ax2.step(range(len(tokens)), tokens, where="post", label="output tok/s")
    ax2.axhline(m["output_throughput"], linestyle="--", color="grey", label="mean over the run")
    ax2.set_xlabel("seconds from the first request")
    ax2.set_ylabel("output tokens/s")
    ax2.set_title("Throughput over time")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------- the run


async def first_model(session, root: str, headers: dict) -> str:
    async with session.get(root + "/v1/models", headers=headers) as resp:
        if resp.status != 200:
            raise SystemExit(f"folio bench serve: {root}/v1/models answered HTTP {resp.status}; pass --model")
        data = await resp.json(content_type=None)
    models = data.get("data") or []
    if not models:
        raise SystemExit(f"folio bench serve: {root}/v1/models lists no model; pass --model")
    return models[0]["id"]


async def run(args) -> dict:
    import aiohttp
    from tqdm import tqdm

    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        try:
            if args.model is None:
                args.model = await first_model(session, args.root, args.headers)
            tok = await pick_tokenizer(args, session)
        except aiohttp.ClientError as exc:
            raise SystemExit(f"folio bench serve: {args.root}: {exc}") from None
        print(f"Model: {args.model}; endpoint: {args.root}/v1/{'chat/' if args.endpoint == 'chat' else ''}completions")
        print(f"Tokenizer: {tok.describe() if tok else 'none (a word counts as a token; input totals from usage)'}")
        prompts = await build_prompts(args, tok)

        print("Starting initial single prompt test run...")
        ignore_eos = args.ignore_eos
        test = await send(session, args, prompts[0], ignore_eos)
        if not test.success and ignore_eos and test.error.startswith("HTTP 400"):
            test = await send(session, args, prompts[0], False)
            if test.success:
                ignore_eos = False
                print("The endpoint refuses ignore_eos: outputs may end before --output-len.")
        if not test.success:
            raise SystemExit(f"folio bench serve: the test request failed: {test.error}")
        print("Initial test run completed. Starting main benchmark run...")
        print(f"Traffic request rate: {args.request_rate}")
        kind = "Poisson process" if args.burstiness == 1 else "Gamma distribution"
        print(f"Burstiness factor: {args.burstiness} ({kind})")
        print(f"Maximum request concurrency: {args.max_concurrency}")

        bar = tqdm(total=len(prompts), disable=args.disable_tqdm, file=sys.stderr)
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def one(i: int) -> RequestResult:
            if sem is None:
                res = await send(session, args, prompts[i], ignore_eos)
            else:
                async with sem:
                    res = await send(session, args, prompts[i], ignore_eos)
            bar.update(1)
            return res

        start = time.perf_counter()
        tasks = []
        async for i in arrivals(len(prompts), args.request_rate, args.burstiness, random.Random(args.seed + 1)):
            tasks.append(asyncio.create_task(one(i)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()

    m = compute_metrics(results, duration, args.slos, args.metric_percentiles)
    print_block(" Serving Benchmark Result ", result_rows(m, args))
    errors = sorted({r.error for r in results if not r.success})
    for err in errors[:5]:
        print(f"failed: {err}")
    out = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "openai-chat" if args.endpoint == "chat"
           else "openai", "base_url": args.root, "model_id": args.model,
           "tokenizer_id": tok.describe() if tok else None, "dataset": args.dataset, "num_prompts": len(prompts),
           "request_rate": args.request_rate if not math.isinf(args.request_rate) else "inf",
           "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "seed": args.seed,
           "ignore_eos": ignore_eos, "goodput": args.slos or None, **m,
           "input_lens": [r.input_len for r in results], "output_lens": [r.output_tokens for r in results],
           "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
           "generated_texts": [r.text for r in results], "errors": [r.error for r in results]}
    if args.save_result:
        write_json(args.save_result, out)
        print(f"Saved the result to {args.save_result}")
    if args.plot:
        plot(args.plot, m, results, args.metric_percentiles)
        print(f"Saved the plot to {args.plot}")
    return out


async def pick_tokenizer(args, session):
    if args.tokenizer == "none":
        return None
    if args.tokenizer != "auto":
        return LocalTokenizer(args.tokenizer)
    tok = await HttpTokenizer.probe(session, args.root, args.model)
    if tok is None:
        print("The endpoint has no /tokenize: prompts are counted in words (pass --tokenizer PATH for exact lengths).")
    return tok


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="folio bench serve", description=__doc__.splitlines()[0].strip("`: "),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="the workload of a serving script (" + ", ".join(sorted(PRESETS)) + "); flags given win")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's root (a trailing /v1 is dropped)")
    p.add_argument("--model", default=None, help="default: the endpoint's first model (GET /v1/models)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="sent as a bearer token")
    p.add_argument("--dataset", choices=("random", "prefix-repetition", "sharegpt"), default="random")
    p.add_argument("--dataset-path", default=None, help="the ShareGPT JSON file (--dataset sharegpt)")
    p.add_argument("--num-prompts", type=_positive_int, default=1000)
    p.add_argument("--request-rate", type=_rate, default=math.inf, help="requests per second (Poisson) or inf")
    p.add_argument("--burstiness", type=_positive_float, default=1.0, help="1: Poisson; lower: burstier (gamma)")
    p.add_argument("--max-concurrency", type=_positive_int, default=None)
    p.add_argument("--input-len", type=_positive_int, default=1024, help="random: prompt tokens")
    p.add_argument("--output-len", type=_positive_int, default=None,
                   help="output tokens (default 128; sharegpt: each conversation's answer)")
    p.add_argument("--range-ratio", type=_ratio, default=0.0,
                   help="random: lengths uniform in [L(1-r), L(1+r)], 0 <= r < 1")
    p.add_argument("--prefix-repetition-prefix-len", type=_positive_int, default=256)
    p.add_argument("--prefix-repetition-suffix-len", type=_positive_int, default=256)
    p.add_argument("--prefix-repetition-num-prefixes", type=_positive_int, default=10)
    p.add_argument("--prefix-repetition-output-len", type=_positive_int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default="auto",
                   help="auto: the endpoint's /tokenize; a local tokenizer folder; none: count words")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not ask for ignore_eos (outputs may then end early)")
    p.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS", help="SLOs: ttft:200 tpot:50 e2el:1000")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl", help="of ttft,tpot,itl,e2el")
    p.add_argument("--metric-percentiles", default="99", help="comma list, e.g. 50,90,99")
    p.add_argument("--request-timeout", type=_positive_float, default=600.0, help="seconds per request")
    p.add_argument("--save-result", default=None, metavar="FILE.json")
    p.add_argument("--plot", default=None, metavar="FILE.png")
    p.add_argument("--disable-tqdm", action="store_true")
    return p


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
    return value


def _rate(text: str) -> float:
    return math.inf if text.strip().lower() == "inf" else _positive_float(text)


def _ratio(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), not {text}")
    return value


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    first = parser.parse_args(argv)
    if first.preset:
        parser.set_defaults(**PRESETS[first.preset])
    args = parser.parse_args(argv)
    args.output_len_given = args.output_len is not None
    if args.output_len is None:
        args.output_len = 128
    try:
        args.slos = parse_goodput(args.goodput)
    except ValueError as exc:
        parser.error(str(exc))
    args.percentile_metrics = [x.strip() for x in args.percentile_metrics.split(",") if x.strip()]
    unknown = set(args.percentile_metrics) - set(PERCENTILE_METRICS)
    if unknown:
        parser.error(f"--percentile-metrics: unknown {', '.join(sorted(unknown))} (of {', '.join(PERCENTILE_METRICS)})")
    try:
        args.metric_percentiles = [float(x) for x in args.metric_percentiles.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--metric-percentiles takes numbers, not '{args.metric_percentiles}'")
    if any(not 0 < p <= 100 for p in args.metric_percentiles):
        parser.error("--metric-percentiles must lie in (0, 100]")
    if args.dataset == "sharegpt" and not args.dataset_path:
        parser.error("--dataset sharegpt needs --dataset-path FILE")
    root = args.base_url.rstrip("/")
    args.root = root[:-3] if root.endswith("/v1") else root
    args.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    out = asyncio.run(run(args))
    return 0 if out["completed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
