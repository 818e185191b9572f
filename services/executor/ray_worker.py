"""A rank of the executor's tensor-parallel group as a Ray actor (``workers.RayWorkers`` makes
them, one per placement-group bundle): it runs ``workers.worker_main`` until rank 0 says stop."""

from __future__ import annotations


class RayWorker:
    def run(self, rank: int, size: int, host: str, port: int, config, model_path: str) -> None:
        from folio.services.executor.workers import worker_main

        # the actor sees only its bundle's GPU (index 0); Ray ends actors whose owner is gone
        worker_main(rank, size, host, port, config, model_path, 0, die_with_parent=False)
