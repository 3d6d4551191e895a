"""The `fused` backend: the graph step with plan ops replaced by the harness's registered Triton and CuTe DSL kernels
(backends/fused/kernels/, their preference order in backends/fused/kernels/catalog.py), captured."""
