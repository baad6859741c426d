"""Cache accounting, torch-free: KV blocks and prefix hashes, linear-attention state slots and their snapshots."""
