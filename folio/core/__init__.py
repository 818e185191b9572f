"""The engine core: everything that computes, and no sockets.

The scheduler's policy with its allocator replica (``scheduler/``), the model runner and what it
runs (``executor/``), the detokenizer and output processing (``tokenizer/``), and the one front
door that turns user parameters into an engine request (``frontdoor.py``). ``engine.py`` steps
them in one process for ``folio.LLM``; each service under ``services/`` is a shell (sockets, loop,
admin) around its part. Rules (checked by ``tests/test_layout.py``): nothing here imports
``folio.services``; ``scheduler/``, ``tokenizer/`` and ``frontdoor.py`` never import torch.
"""
