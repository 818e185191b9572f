"""``folio run tokenizer``: parse flags into ``TokenizerConfig`` and serve until SIGTERM/SIGINT.

Sockets come from the environment (``folio.shared.config.Endpoints.from_env``), as for every service.
"""

from __future__ import annotations

import asyncio
import gc
import sys

from folio.shared.config import Endpoints, TokenizerConfig
from folio.shared.flags import config_values, service_parser
from folio.shared.logs import setup_logging


def parse_config(argv: list[str] | None = None) -> TokenizerConfig:
    args = service_parser("tokenizer", __doc__.splitlines()[0]).parse_args(argv)
    return TokenizerConfig(endpoints=Endpoints.from_env(), **config_values(TokenizerConfig, args, "tokenizer"))


def main(argv: list[str] | None = None) -> int:
    from folio.shared.loops import freeze_heap, run_until_signal
    from folio.core.models import resolve_model
    from folio.services.tokenizer.service import TokenizerService
    from folio.core.tokenizer.text import TextTokenizer

    config = parse_config(argv)
    log = setup_logging("tokenizer", config.log_json, config.log_level)
    try:
        model_dir = resolve_model(config.model)
    except FileNotFoundError as exc:
        log.error("no model", error=str(exc))
        return 1
    tokenizer = TextTokenizer(model_dir, config.max_model_len)
    freeze_heap()  # transformers and the tokenizer: ~300,000 objects

    async def serve() -> None:
        # xgrammar's import (in a worker, once serving) adds as many long-lived objects again: frozen
        # too, without a collection (``gc.freeze`` alone, safe from that thread)
        service = TokenizerService(config, tokenizer, after_warm=gc.freeze)
        try:
            await service.run()
        finally:
            service.close()

    return asyncio.run(run_until_signal(serve(), log))


if __name__ == "__main__":
    sys.exit(main())
