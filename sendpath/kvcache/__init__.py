"""The paged KV cache's bookkeeping: blocks, ref counts, prefix hashes (torch-free)."""
