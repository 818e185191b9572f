"""The runtime: the model runner, its persistent input batch, the KV pool, CUDA graphs, draft proposers."""
