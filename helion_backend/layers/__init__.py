"""User-facing quantized layers (plain PyTorch; importing them needs neither Helion nor the backend)."""
