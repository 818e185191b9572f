"""Model families (one file each, over shared layers) and checkpoint loading."""
