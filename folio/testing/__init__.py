"""Tiny random-weight checkpoints and local stacks of the real services, shared by the benchmarks
under ``scripts/`` and by the tests.

- ``models``: tiny random-weight Llama-family checkpoints written to disk (with SmolLM2's tokenizer
  for the ones the tokenizer service must read).
- ``backhalf``: the real kvmanager, executor and scheduler in one asyncio loop on ``ipc://`` sockets,
  with the tokenizer's two sockets in the caller's hands.
- ``server``: ``folio serve`` started for real, as a subprocess, and stopped.
- ``routerstack``: ``folio serve`` replicas publishing KV events, and ``folio run router`` in front.
- ``faults``: a ``folio serve`` whose service processes can be killed, a mixed workload of streams
  and a client that sorts each stream's outcome.

Nothing here imports pytest or the tests.
"""
