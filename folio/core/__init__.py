"""The engine core: everything that computes, and no sockets.

The scheduler's policy with its allocator replica (``scheduler/``, ``kv/``), the model runner and what
it runs (``executor/``, with the KV memory in ``kv/tensors/``), the detokenizer and output processing
(``tokenizer/``), and the one front door that turns user parameters into an engine request
(``frontdoor.py``). ``engine.py`` steps them in one process for ``folio.LLM``; each service under
``services/`` is a shell (sockets, loop, admin) around its part. ``tests/test_layout.py`` checks
that nothing here imports a service or reaches zmq, and that ``scheduler/``, ``kv/``, ``tokenizer/``
and ``frontdoor.py`` never import torch.
"""
