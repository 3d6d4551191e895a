"""Triton (and plain-torch) implementations of plan ops, each registered as a validation variant.

Importing a kernel module decorates its @triton.jit functions: for CPU runs set TRITON_INTERPRET=1
before that import. This package's __init__ imports nothing, so importing one kernel module does not
decorate the others.
"""
