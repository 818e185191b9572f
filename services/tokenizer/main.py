"""``folio run tokenizer``: parse flags into ``TokenizerConfig`` and serve until SIGTERM/SIGINT.

Sockets come from the environment (``folio.shared.config.Endpoints.from_env``), as for every service.
"""

from __future__ import annotations

import gc
import sys

from folio.shared.config import TokenizerConfig
from folio.services.shell import ServiceSpec, StartError


def open_service(config: TokenizerConfig, ctx, log):
    from folio.core.model_files import resolve_model
    from folio.core.tokenizer.text import TextTokenizer
    from folio.services.tokenizer.service import TokenizerService

    try:
        model_dir = resolve_model(config.model)
    except FileNotFoundError as exc:
        raise StartError("no model", error=str(exc)) from exc
    # xgrammar's import (in a worker, once serving) adds as many long-lived objects as transformers
    # and the tokenizer (~300,000): frozen too, without a collection (``gc.freeze`` alone, safe from
    # that thread)
    return TokenizerService(config, TextTokenizer(model_dir, config.max_model_len), ctx, after_warm=gc.freeze)


SPEC = ServiceSpec("tokenizer", TokenizerConfig, __doc__.splitlines()[0], open_service)

parse_config, main = SPEC.config, SPEC.main

if __name__ == "__main__":
    sys.exit(main())
