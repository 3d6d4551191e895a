"""Weight quantization formats: storage layouts and exact decoders (the reference for fused kernels)."""

from .mxfp4 import MXFP4Tensor, dequantize_mxfp4, quantize_mxfp4

__all__ = ["MXFP4Tensor", "dequantize_mxfp4", "quantize_mxfp4"]
