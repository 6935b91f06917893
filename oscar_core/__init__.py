"""oscar: OSCAR rotation bundles for 2-bit KV caches.

The pipeline's stages are packages, lowest first; a stage imports only the flat modules and the stages below it
(tests/test_layout.py checks this):
    oscar_core/*.py        the math and shared descriptions: errors, quant, rope, rotations, metrics, kvstore, layers,
                           equivalence
    oscar_core/formats/    the bundle manifest, safetensors I/O and atomic writes, provenance
    oscar_core/calibrate/  text -> model with hooks -> statistics -> rotations -> bundle
    oscar_core/triton/     the write and decode kernels (read kvstore's layout)
    oscar_core/serve/      the INT2 cache for transformers and how its attention reaches the kernels
    oscar_core/evaluate/   perplexity, needles, RULER, verify
    oscar_core/publish/    the authors' files, model cards, hub pushes, the zoo
"""

__version__ = "0.1.0"
