"""The simulator: the real scheduler, KV manager and router on a virtual clock (torch-free)."""
