"""The megakernel's tensor-core expert bodies (F_FRAG, backends/mega/cute/moe.py) against alternatives, by launch time
on the GPU, as bench/mega_sync_ab.py measures the loop: each variant is a build of the kernel with module-level
functions swapped for one compile (the shipped source holds no switch), first diffed against pyvm
(validate.mega_gpu.diff_program on tiny-k3-frag at batch 1 and 3, delayed launches included), then timed on
k3-mini (experts in fragment order) in interleaved rounds (mega_sync_ab.timed). Medians to --out as JSON.

    python bench/mega_frag_ab.py --batch 1,8 --out $OUT/mega-frag-ab.json

A variant is a list of (module, name, replacement) swaps (`_swaps`); `shipped` is the kernel as it is. The variants
measured so far, and their results, are in docs/megakernel.md ("K3's MXFP4 experts on the tensor cores"): at
918ac56 EXPERT_UP staged against the per-warp conversion and two or three records a trip
(bench/results/mega-frag-ab-nvidia-h200.json); at 3c9504e EXPERT_DOWN's per-warp conversion with two records a trip
and per-block scales (bench/results/mega-frag-ab-down-nvidia-h200.json), none faster. Their bodies are in git
(`git show cacde6b:bench/mega_frag_ab.py`); EXPERT_DOWN has since been made pair-major and staged like EXPERT_UP,
which those variants no longer fit.
"""


from megadecode.backends.mega.runtime import compile_launcher
from mega_sync_ab import ab_parser, ab_variants, run_ab, swapped  # bench/: options, swaps, checks, timing

VARIANTS = ("shipped",)


def _swaps(name: str) -> list[tuple[object, str, object]]:
    """The variant's swaps (none for `shipped`)."""
    if name == "shipped":
        return []
    raise ValueError(f"unknown variant {name!r}")


def build(name: str, device):
    with swapped(_swaps(name)):
        return compile_launcher(device, cache=False)


def build_ptx(name: str) -> str:
    """The variant's PTX compiled without a GPU (the CPU test of each variant's trace)."""
    from megadecode.backends.mega import cute_kernel as K

    with swapped(_swaps(name)):
        return K.compile_ptx_cubin().__ptx__


def main(argv=None) -> int:
    ap = ab_parser("k3-mini", "1,8", 15, ",".join(VARIANTS), "mega-frag-ab.json")
    args = ap.parse_args(argv)
    names = ab_variants(ap, args, VARIANTS)
    run_ab(names, build, "tiny-k3-frag", args.preset, args.batch, args.context, args.rounds, args.out)
    print(f"wrote {args.out}")
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
