"""The megakernel's device code in CuTe DSL, by concern (the persistent loop is mega/cute_kernel.py):

    base.py       constants, memory access by address, warp reductions, the hash, RoPE, the online-softmax chunk
    dense.py      MATVEC / GLU (rows of a weight against every token), EMBED, MERGE, SAMPLE
    attention.py  ATTN_GQA and the MLA opcodes
    moe.py        ROUTE, EXPERT_UP, EXPERT_DOWN

Importing this package sets CUTE_DSL_ARCH (read when cutlass is first imported) to the H200's sm_90a; every compile
also names it (--gpu-arch).
"""

import os

ARCH = "sm_90a"
os.environ.setdefault("CUTE_DSL_ARCH", ARCH)
