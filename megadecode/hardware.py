"""Measured figures of the GPU we build and measure on (/work/shared/GPU.md), for the cost models and floors."""

# HBM read bandwidth of our H200: a Triton streaming read of 4 GiB bf16, median of do_bench (measured
# 2026-11-29). The floor of a decode step is its bytes over this.
HBM_READ_BPS = 4.57e12
