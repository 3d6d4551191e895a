"""Expert parallelism over torch.distributed (issue 17): one process per GPU (NCCL) or per CPU rank (gloo), the
routed experts split across ranks, the trunk replicated.

    experts.py   which experts a rank owns (contiguous blocks of E / world) and its view of the router's picks
    combine.py   the sum of the ranks' partial expert outputs, deterministic, in two communication modes
    vocab.py     the lm_head split by rows over the ranks, and the all-gather of the logits
    group.py     the process group from torchrun's environment, its timeout, and agreeing on failures
    launch.py    the command line starting its own ranks when it is not run under torchrun

docs/ep-model.md models the step time against the number of GPUs; docs/expert-parallelism.md has the commands.
"""
