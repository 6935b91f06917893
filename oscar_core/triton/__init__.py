"""Triton kernels of the INT2 KV store: write (rotate, quantize, pack) and decode attention (docs/kernels.md)."""
