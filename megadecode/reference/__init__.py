"""The reference implementation of every plan op: plain PyTorch, fp32-capable, readable.

This package is the spec the fast paths are validated against.
"""
