"""Tiny random-weight checkpoints and local stacks of the real services (started as processes),
shared by the benchmarks under ``scripts/`` and by the tests.

- ``models``: tiny random-weight Llama-family checkpoints written to disk (with SmolLM2's tokenizer
  for the ones the tokenizer service must read).
- ``server``: ``folio serve`` started for real, as a subprocess, and stopped.
- ``routerstack``: ``folio serve`` replicas publishing KV events, and ``folio run router`` in front.
- ``faults``: a ``folio serve`` whose service processes can be killed, a mixed workload of streams
  and a client that sorts each stream's outcome.

Nothing here imports pytest, the tests or a service (``folio.services.in_process`` runs services
in the caller's process).
"""
