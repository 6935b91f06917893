"""oscar: OSCAR rotation bundles for 2-bit KV caches."""

__version__ = "0.1.0"
