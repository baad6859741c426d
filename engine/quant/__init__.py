"""Quantized linear weights: FP8 with 128x128 block scales (Qwen's published layout) and NVFP4
(ModelOpt's layout). `formats` holds the reference dequantizers written from the format
descriptions; `scheme` reads a checkpoint's quantization config; `linear` holds the layer methods;
`quantize` writes those layouts from a bf16/fp32 checkpoint. Importing this package needs torch only."""
