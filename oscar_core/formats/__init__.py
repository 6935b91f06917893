"""What a bundle is on disk: the manifest and its checks (bundle), safetensors I/O and atomic writes (fileio), where a
bundle was built (provenance)."""
