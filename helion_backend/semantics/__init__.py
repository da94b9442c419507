"""What fused steps compute, in torch: the epilogue steps, the RMSNorm prologue and the quantization
programs, with their string forms. One definition shared by the compile side (which builds and formats
them), the reference and the kernels (which run them)."""
