"""The megakernel's device code in CuTe DSL, by concern (the persistent loop is backends/mega/cute_kernel.py):

    base.py       constants, memory access by address, warp reductions, the hash, RoPE, the online-softmax chunk
    dense.py      MATVEC / GLU (rows of a weight against every token), EMBED, MERGE, SAMPLE
    attention.py  ATTN_GQA and the MLA opcodes
    moe.py        ROUTE, EXPERT_UP, EXPERT_DOWN

The generic device helpers (memory access by address, warp reductions, activations) are ../../cute_device.py's;
importing this package sets CUTE_DSL_ARCH (read when cutlass is first imported) through it; every compile also
names it (--gpu-arch).
"""

from ...cute_device import ARCH  # noqa: F401
