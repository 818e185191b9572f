"""The KV cache's memory, held by the executor: the pool's tensors (``pool.py``), their bytes to and
from the disk tier's files (``disk.py``) and another executor's pool (``transfer.py``), and the FP8
pool's calibration (``calibration.py``). The block bookkeeping over it is ``folio.core.kv``."""
