"""Recognizers: pure functions over FX nodes that say what an op chain computes (epilogue steps, RMSNorm,
activation quantization, weight dequantization). They never mutate the graph."""
