"""Structured output, one module per stage a request's grammar goes through:

- ``grammar.py``: a request's spec -> a checked grammar (the tokenizer, before anything is
  scheduled), and its compile against the vocabulary;
- ``scheduling.py``: the scheduler holds a request's first sampled token until its grammar compiled;
- ``masks.py``: the executor's compiled grammars, a matcher per request, the allowed-token masks.

The gateway's part (request fields -> a spec, text -> tool calls) is HTTP and stays in
``services/gateway/structured.py``. Only ``masks.py`` imports torch.
"""
