"""``python -m voice_trainers probe``: one JSON line describing the torch build and the GPU this host offers.

The worker runs it at start-up and decides from it whether the host is fit; the probe itself judges
nothing and exits 0 whenever it ran (docs/trainer.md, "The probe"). Fields, always present (null when
unknown or not applicable):

- ``torch``: torch's version; ``cuda_runtime``: the CUDA version torch was built with (null for a CPU build);
- ``cuda_available``: ``torch.cuda.is_available()``; ``device_count``: the devices torch sees;
- ``driver_version``: the NVIDIA kernel driver's version (``/proc/driver/nvidia/version``);
- ``cuda_driver_api``: the CUDA version the driver supports, as torch reads it (``12040`` is 12.4);
- ``device_name``, ``device_total_memory_bytes``, ``device_capability``: device 0 (what
  ``CUDA_VISIBLE_DEVICES`` makes device 0);
- ``cudnn``: cuDNN's version as torch reports it (``90100`` is 9.1.0), null when unavailable.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

NVIDIA_DRIVER_FILE = Path("/proc/driver/nvidia/version")
_DRIVER = re.compile(r"Kernel Module(?:\s+for\s+\S+)?\s+([0-9][0-9.]*)")


def driver_version(path: Path = NVIDIA_DRIVER_FILE) -> str | None:
    """The NVIDIA kernel module's version ("550.54.15"), None where there is none."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    match = _DRIVER.search(text)
    return match.group(1) if match else None


def probe(torch: Any) -> dict[str, Any]:
    available = bool(torch.cuda.is_available())
    report: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cuda_available": available,
        "device_count": torch.cuda.device_count() if available else 0,
        "driver_version": driver_version(),
        "cuda_driver_api": None,
        "device_name": None,
        "device_total_memory_bytes": None,
        "device_capability": None,
        "cudnn": None,
    }
    try:
        report["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except Exception:  # a broken cuDNN is what the probe is for: report it as absent
        report["cudnn"] = None
    if available:
        properties = torch.cuda.get_device_properties(0)
        report["device_name"] = properties.name
        report["device_total_memory_bytes"] = int(properties.total_memory)
        report["device_capability"] = f"{properties.major}.{properties.minor}"
        try:
            report["cuda_driver_api"] = int(torch._C._cuda_getDriverVersion())
        except Exception:  # a private call: absent from some builds
            report["cuda_driver_api"] = None
    return report


def main(argv: list[str]) -> int:
    if argv:
        print(f"probe takes no arguments, got {argv[:3]}", file=sys.stderr, flush=True)
        return 2
    import torch

    print(json.dumps(probe(torch), sort_keys=True), flush=True)
    return 0
