"""The `torch` backend: every plan op in plain PyTorch (executor.py, the reference and HF-parity path; ops.py the op
implementations)."""
