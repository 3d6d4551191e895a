"""What the CuTe megakernel holds per CTA, in one place for the kernel (cute/base.py, cute/attention.py) and the host
code that sizes and checks programs for it (layers.py, ops/, kernel_check.py), which imports no CuTe; and the error a
program past them raises."""

from __future__ import annotations

NT = 256  # threads per CTA
SMEM_F = 12288  # fp32 words of shared memory per CTA (48 KiB)
SMEM_I = 2048  # int32 words (8 KiB)
BODY_I = SMEM_I - 112  # int32 words a body may use, below the two instruction rows (cute/base.py's NEXT_S)
# The weight ring (cute/base.py): RING_SLOTS pages of RING_PAGE bytes of shared memory a CTA, into which one thread
# streams the static rows of its queue's staged instructions (isa.F_STAGE) ahead of their waits. With the working
# memory above, one CTA an SM (the ring is most of the SM's 228 KiB).
RING_SLOTS = 10
RING_PAGE = 16384
MLA_HB = 8  # the most heads an MLA_ATTN instruction holds (cute/attention.py: its score sums per thread)


class KernelLimit(ValueError):
    """A program the CuTe kernel cannot run as written, naming the instruction and the reason."""
