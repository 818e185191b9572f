"""Model families (one file each, over shared layers) and checkpoint loading (whole, or one
tensor-parallel rank's shard: ``sharded_load.py``)."""
