"""Where a bundle was built: the platform facts that explain a byte difference between two builds, and
where the model was loaded from.

A rebuild on the same machine and software is byte-identical; elsewhere the forward pass (oneDNN / MKL
kernels chosen by CPU), LAPACK's eigensolver and torch's vectorized kernels (the instruction set torch
dispatches to, ATEN_CPU_CAPABILITY) move the last bits (see oscar_core/equivalence.py).
"""

import platform
import re
from pathlib import Path

import torch


def _config_value(key: str) -> str:
    match = re.search(rf"{key}=([^,\s]+)", torch.__config__.show())
    return match.group(1) if match else "unknown"


def _processor() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux; platform.processor() elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def platform_record(device: str = "cpu") -> dict[str, str]:
    """torch and Python versions, BLAS and LAPACK vendors, the CPU instruction set torch dispatches to,
    machine and processor, and the device (with the GPU's name on CUDA)."""
    if str(device).startswith("cuda") and torch.cuda.is_available():
        device = f"{device} ({torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda})"
    return {"torch": torch.__version__, "python": platform.python_version(),
            "blas": _config_value("BLAS_INFO"), "lapack": _config_value("LAPACK_INFO"),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "machine": platform.machine(), "processor": _processor(), "device": str(device)}


def model_source(spec: str | None) -> str:
    """Where a model spec loads from, as a hint for later commands: 'default', 'packaged:<name>', an absolute path, or a hub id."""
    if spec in (None, "", "default") or spec.startswith("packaged:"):
        return spec or "default"
    path = Path(spec).expanduser()
    return str(path.resolve()) if path.exists() else spec
