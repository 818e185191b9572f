"""The runtime: the model runner, its persistent input batch, the check of each step plan
(``plan_check.py``), CUDA graphs, draft proposers, and the tensor-parallel worker group
(``workers.py``) that runs a runner per rank. The KV pool it steps on is ``folio.core.kv.tensors``."""
