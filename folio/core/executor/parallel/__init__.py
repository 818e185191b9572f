"""Tensor parallelism: process groups (``comm.py``), sharded loading, worker processes (local or Ray)."""
