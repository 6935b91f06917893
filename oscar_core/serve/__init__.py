"""Serving a bundle: the KV cache methods (methods), the transformers cache (cache) and how its attention reaches the
kernels (attention), R_V in the weights (absorb), CUDA-graph decoding (decode_graph), and what every query reads as
a teacher-forced simulation (simulate).

`from oscar_core.serve import OscarCache` imports the cache (and torch, transformers) on first use only.
"""


def __getattr__(name: str):
    if name == "OscarCache":
        from oscar_core.serve.cache import OscarCache
        return OscarCache
    raise AttributeError(f"module 'oscar_core.serve' has no attribute {name!r}")
