#!/usr/bin/env bash
# One GPU session's evidence for the Triton variants and the fused executor, in one call (device time is
# scarce: run this, then unpack $OUT/evidence.tar.gz: evidence/*.md to docs/evidence/, results/*.json to
# bench/results/). The device returns at most 8 files, so reports and results travel as one archive.
#   OUT=/path bash bench/gpu_evidence.sh [quick] [variant ...]
# quick: the GPU tests and the harness reports only (no benchmarks). Variants: default all of them.
set -uo pipefail
FINAL=${OUT:-out}
OUT=$(mktemp -d)
trap 'tar -czf "$FINAL/evidence.tar.gz" -C "$OUT" evidence results' EXIT
mkdir -p "$OUT/evidence" "$OUT/results" "$FINAL"
M="python -m megadecode.cli"
python -m pytest -q -p no:cacheprovider tests/test_grouped_experts.py tests/test_fused_experts.py \
    tests/test_latent_moe_kernels.py tests/test_kda_kernel.py tests/test_mla_kernel.py tests/test_k3_graph.py \
    tests/test_fused_executor.py tests/test_lm_head_kernel.py 2>&1 | tee "$OUT/evidence/pytest-gpu.log" | tail -5
MODE=${1:-full}
shift || true
VARIANTS=${*:-triton-grouped-experts triton-add-rmsnorm triton-router triton-latent-moe triton-kda-decode \
    triton-mla-decode triton-gqa-decode triton-lm-head}
for v in $VARIANTS; do
    $M validate "$v" --seeds 1 --report "$OUT/evidence" 2>&1 | tail -2
done
[ "$MODE" = quick ] && exit 0
$M bench --preset k3-moe --executor torch,graph,fused --batch 1,8,64,256 --out "$OUT/results/k3-moe.json" 2>&1 | tail -20
$M bench --preset k3-mini --executor torch,graph,fused --batch 1,8,64 --steps 10 --warmup 2 \
    --out "$OUT/results/k3-mini.json" 2>&1 | tail -11
$M bench --preset k3-layer --executor torch,graph,fused --batch 1,8,64 --out "$OUT/results/k3-layer.json" 2>&1 | tail -11
$M bench --preset qwen3-30b-a3b --executor graph,compiled,fused --batch 1,8,64 \
    --out "$OUT/results/qwen3-30b-a3b.json" 2>&1 | tail -11
