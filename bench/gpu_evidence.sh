#!/usr/bin/env bash
# One GPU session's evidence for the Triton variants and the fused executor, in one call (device time is
# scarce: run this, then copy $OUT/evidence/*.md to docs/evidence/ and $OUT/results/*.json to bench/results/).
#   OUT=/path bash bench/gpu_evidence.sh [quick]
# quick: the GPU tests and the harness reports only (no benchmarks).
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT/evidence" "$OUT/results"
M="python -m megadecode.cli"
python -m pytest -q -p no:cacheprovider tests/test_grouped_experts.py tests/test_fused_experts.py \
    tests/test_latent_moe_kernels.py tests/test_kda_kernel.py tests/test_mla_kernel.py tests/test_k3_graph.py \
    tests/test_fused_executor.py 2>&1 | tail -5
for v in triton-grouped-experts triton-add-rmsnorm triton-router triton-latent-moe triton-kda-decode triton-mla-decode \
        triton-gqa-decode; do
    $M validate "$v" --seeds 1 --report "$OUT/evidence" 2>&1 | tail -2
done
[ "${1:-}" = quick ] && exit 0
$M bench --preset k3-moe --executor torch,graph,fused --batch 1,8,64,256 --out "$OUT/results/k3-moe.json" 2>&1 | tail -20
$M bench --preset k3-mini --executor torch,graph,fused --batch 1,8,64 --steps 10 --warmup 2 \
    --out "$OUT/results/k3-mini.json" 2>&1 | tail -11
$M bench --preset k3-layer --executor torch,graph,fused --batch 1,8,64 --out "$OUT/results/k3-layer.json" 2>&1 | tail -11
$M bench --preset qwen3-30b-a3b --executor graph,compiled,fused --batch 1,8,64 \
    --out "$OUT/results/qwen3-30b-a3b.json" 2>&1 | tail -11
