"""``folio run executor``: parse flags (vLLM's names), load the model, serve steps until SIGTERM/SIGINT."""

from __future__ import annotations

import sys

from folio.shared.config import ExecutorServiceConfig, RuntimeConfig
from folio.shared.flags import config_values
from folio.services.shell import ServiceSpec
from folio.core.executor.runtime.spec_config import speculative_refusal


def check(parser, args) -> None:
    from folio.core.model_files import resolve_model

    if args.lora_modules and not args.enable_lora:
        parser.error("--lora-modules needs --enable-lora")
    refusal = speculative_refusal(args)
    if refusal:
        parser.error(refusal)
    try:  # resolved here, where a missing model is a message and not a traceback
        args.model_path = str(resolve_model(args.model))
    except FileNotFoundError as exc:
        parser.error(str(exc))


def fields(args) -> dict:
    return {"runtime": RuntimeConfig(**config_values(RuntimeConfig, args, "executor")),
            "model_path": args.model_path}


def open_service(config: ExecutorServiceConfig, ctx, log):
    from folio.core.executor.threads import choose_spin_count

    runtime = config.runtime
    choose_spin_count(config.model_path, runtime.quantization, runtime.device)  # before torch loads
    from folio.services.executor.service import ExecutorService

    service = ExecutorService(config, ctx)
    log.info("model loaded", **service.runner.stats())
    return service


SPEC = ServiceSpec("executor", ExecutorServiceConfig, "the model runtime service", open_service, check=check,
                   fields=fields, starting=lambda config: {"model": config.model_path})

parse_config, main = SPEC.config, SPEC.main

if __name__ == "__main__":
    sys.exit(main())
