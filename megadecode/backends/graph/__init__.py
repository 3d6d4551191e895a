"""The `graph` and `compiled` backends: the per-op step without host syncs, captured in a CUDA graph (the second
through torch.compile first)."""
