"""What the CuTe megakernel holds per CTA, in one place for the kernel (cute/base.py, cute/attention.py) and the host
code that sizes and checks programs for it (layers.py, ops/, kernel_check.py), which imports no CuTe; and the error a
program past them raises."""

from __future__ import annotations

NT = 256  # threads per CTA
SMEM_F = 12288  # fp32 words of shared memory per CTA (48 KiB)
SMEM_I = 2048  # int32 words (8 KiB)
BODY_I = SMEM_I - 112  # int32 words a body may use, below the two instruction rows (cute/base.py's NEXT_S)
MLA_HB = 8  # the most heads an MLA_ATTN instruction holds (cute/attention.py: its score sums per thread)


class KernelLimit(ValueError):
    """A program the CuTe kernel cannot run as written, naming the instruction and the reason."""
