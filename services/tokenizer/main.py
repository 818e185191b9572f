"""``folio run tokenizer``: parse flags into ``TokenizerConfig`` and serve until SIGTERM/SIGINT.

Sockets come from the environment (``shared.config.Endpoints.from_env``), as for every service.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from shared.config import (
    DEFAULT_MODEL_NAME,
    Endpoints,
    TokenizerConfig,
    log_json_from_env,
)
from shared.flags import add_common_args
from shared.logs import setup_logging


def parse_config(argv: list[str] | None = None) -> TokenizerConfig:
    parser = argparse.ArgumentParser(prog="folio run tokenizer", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME, help="the default model's name or a model folder")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context length (default: the model's max_position_embeddings)")
    add_common_args(parser)  # --log-json, --log-level
    args = parser.parse_args(argv)
    return TokenizerConfig(endpoints=Endpoints.from_env(), model=args.model, max_model_len=args.max_model_len,
                           log_json=args.log_json or log_json_from_env(), log_level=args.log_level)


def main(argv: list[str] | None = None) -> int:
    from shared.loops import run_until_signal
    from shared.models import resolve_model
    from services.tokenizer.service import TokenizerService
    from shared.text import TextTokenizer

    config = parse_config(argv)
    log = setup_logging("tokenizer", config.log_json, config.log_level)
    try:
        model_dir = resolve_model(config.model)
    except FileNotFoundError as exc:
        log.error("no model", error=str(exc))
        return 1
    tokenizer = TextTokenizer(model_dir, config.max_model_len)

    async def serve() -> None:
        service = TokenizerService(config, tokenizer)
        try:
            await service.run()
        finally:
            service.close()

    return asyncio.run(run_until_signal(serve(), log))


if __name__ == "__main__":
    sys.exit(main())
