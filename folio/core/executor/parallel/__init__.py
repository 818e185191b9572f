"""Tensor parallelism's primitives (``comm.py``): which slice of the model a rank holds and how
ranks talk. The layers and the runner use them; sharded loading is ``model/sharded_load.py`` and
the worker processes (local or Ray) are ``runtime/workers.py``."""
