"""``folio run executor``: parse flags (vLLM's names), load the model, serve steps until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import sys

import zmq.asyncio

from shared.config import DEFAULT_MODEL_NAME, Endpoints, ExecutorServiceConfig, RuntimeConfig, log_json_from_env
from shared.flags import add_common_args
from shared.logs import setup_logging
from shared.loops import run_until_signal


def add_runtime_args(parser: argparse.ArgumentParser, include_model: bool = True) -> None:
    """The runtime's flags, for ``folio run executor`` and (without ``--model``) ``folio serve``."""
    d = RuntimeConfig()
    if include_model:
        parser.add_argument("--model", default=DEFAULT_MODEL_NAME,
                            help="the default model's name, a model folder or a .gguf")
    parser.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--quantization", default=d.quantization,
                        choices=["auto", "none", "int8", "int4", "awq", "fp8"],
                        help="weights: auto keeps the checkpoint's own (the default model: int4); none dequantizes "
                             "to --dtype; int8/int4 round to nearest at load time (CPU: bf16 activations)")
    parser.add_argument("--device", default=d.device, help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (overrides budgets)")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="KV pool budget in bytes (CPU)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    parser.add_argument("--attention-backend", default=d.attention_backend, choices=["auto", "torch", "cuda"])
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="most requests in one step")
    parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                        help="token budget of one step")
    parser.add_argument("--num-host-blocks", type=int, default=d.num_host_blocks,
                        help="host-memory KV blocks that preemption by swapping copies blocks to")
    parser.add_argument("--speculative-model", default=None,
                        help="speculative decoding: a draft model folder sharing the vocabulary, or 'ngram'")
    parser.add_argument("--num-speculative-tokens", type=int, default=d.num_speculative_tokens,
                        help="draft tokens proposed per step")
    parser.add_argument("--ngram-prompt-lookup-max", type=int, default=d.ngram_prompt_lookup_max,
                        help="longest n-gram the ngram proposer matches")
    parser.add_argument("--ngram-prompt-lookup-min", type=int, default=d.ngram_prompt_lookup_min,
                        help="shortest n-gram the ngram proposer matches")
    parser.add_argument("--speculative-disable-by-batch-size", type=int, default=d.speculative_disable_by_batch_size,
                        help="propose nothing while this many requests sample in a step (0: always propose)")


def runtime_config(args: argparse.Namespace) -> RuntimeConfig:
    return RuntimeConfig(model=args.model, dtype=args.dtype, quantization=args.quantization, device=args.device,
                         block_size=args.block_size,
                         num_kv_blocks=args.num_kv_blocks, kv_cache_bytes=args.kv_cache_memory_bytes,
                         gpu_memory_utilization=args.gpu_memory_utilization,
                         max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                         attention_backend=args.attention_backend, num_host_blocks=args.num_host_blocks,
                         speculative_model=args.speculative_model, num_speculative_tokens=args.num_speculative_tokens,
                         ngram_prompt_lookup_max=args.ngram_prompt_lookup_max,
                         ngram_prompt_lookup_min=args.ngram_prompt_lookup_min,
                         speculative_disable_by_batch_size=args.speculative_disable_by_batch_size)


def parse_config(argv: list[str] | None) -> tuple[ExecutorServiceConfig, argparse.Namespace]:
    from shared.models import resolve_model

    parser = argparse.ArgumentParser(prog="folio run executor", description="the model runtime service")
    add_runtime_args(parser)
    add_common_args(parser)
    args = parser.parse_args(argv)
    config = ExecutorServiceConfig(endpoints=Endpoints.from_env(), runtime=runtime_config(args),
                                   model_path=str(resolve_model(args.model)), log_json=args.log_json or log_json_from_env())
    return config, args


async def serve(config: ExecutorServiceConfig, log) -> None:
    from services.executor.service import ExecutorService

    ctx = zmq.asyncio.Context()
    try:
        service = ExecutorService(config, ctx)
        log.info("model loaded", **service.runner.stats())
        await service.run()
    finally:
        ctx.term()


def main(argv: list[str] | None = None) -> int:
    config, args = parse_config(argv)
    log = setup_logging("executor", json=config.log_json, level=args.log_level)
    log.info("starting", model=config.model_path)
    return asyncio.run(run_until_signal(serve(config, log), log))


if __name__ == "__main__":
    sys.exit(main())
