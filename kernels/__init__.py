"""Triton kernels (paged attention over the shared group buffers, KV store, norms, rotary), each
with a plain-torch reference beside it."""
