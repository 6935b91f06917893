"""A small valid bundle for tests: 2 layers, 2 KV heads, head_dim 8, random orthogonal rotations."""

import re
from pathlib import Path

import torch

from oscar_core.formats.bundle import (CalibrationInfo, Manifest, ModelInfo, QuantInfo, RotationInfo, TensorFileInfo,
                                       write_bundle)

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 8


def tiny_manifest(model_id: str = "oscar-test/tiny-llama", fidelity: dict[str, float] | None = None) -> Manifest:
    return Manifest(
        name="oscar-test/" + re.sub(r"[^A-Za-z0-9._-]+", "-", model_id.rsplit("/", 1)[-1]).strip(".-"),
        version="v1",
        model=ModelInfo(id=model_id, revision="a" * 40, file_sha256="b" * 64, config_sha256="c" * 64,
                        architecture="LlamaForCausalLM", num_layers=LAYERS, num_heads=4, num_kv_heads=KV_HEADS,
                        head_dim=HEAD_DIM, max_position_embeddings=2048),
        quant=QuantInfo(key_group_size=8, value_group_size=8, key_clip=0.96, value_clip=0.92,
                        bits_per_element={"32768": 2.2812, "131072": 2.2705}),
        rotation=RotationInfo(key="U_Q·H·P_br", value="U_S·H·P_br", key_centering=False, value_centering=True),
        calibration=CalibrationInfo(data="pydoc_data", data_fingerprint="d" * 16, samples=8, seq_len=512, seed=0,
                                    tokens=4096),
        tensors=TensorFileInfo(sha256="0" * 64, bytes=0),
        max_logit_error=0.5,
        fidelity=fidelity if fidelity is not None else {"logit_error": 0.231, "hadamard_logit_error": 0.289},
    )


def write_tiny_bundle(out_dir: str | Path, model_id: str = "oscar-test/tiny-llama", seed: int = 0,
                      fidelity: dict[str, float] | None = None) -> Manifest:
    """Write the bundle into `out_dir` and return its manifest (with the checksum filled in)."""
    g = torch.Generator().manual_seed(seed)
    manifest = tiny_manifest(model_id, fidelity)
    tensors = {}
    for i in range(LAYERS):
        for side in ("key", "value"):
            q, _ = torch.linalg.qr(torch.randn(KV_HEADS, HEAD_DIM, HEAD_DIM, generator=g, dtype=torch.float64))
            tensors[f"layers.{i}.{side}_rotation"] = q.float()
            tensors[f"layers.{i}.{side}_clip"] = torch.full((KV_HEADS,), 0.96 if side == "key" else 0.92)
        tensors[f"layers.{i}.value_mean"] = torch.randn(KV_HEADS, HEAD_DIM, generator=g)
    return write_bundle(out_dir, manifest, tensors)
