"""The device a stage trains on: the one asked for (``--device``, else the profile's) or none at all.

Torch-free at import, so ``cli`` can name the exception and the exit code before any heavy import.
"""

from __future__ import annotations

from typing import Any

# The host lacks what the stage needs (the CUDA device asked for, the base model's files): the data is not at
# fault, another host may do (sysexits' EX_SOFTWARE number, given this meaning in docs/trainer.md).
EXIT_HOST_UNFIT = 70


class HostUnfit(Exception):
    """This host cannot run the stage as asked; a retry on a fit host can (exit 70)."""


def select_device(torch: Any, wanted: str) -> Any:
    """``torch.device(wanted)``, or HostUnfit saying what is missing: never a silent run on the CPU."""
    if wanted == "cpu":
        return torch.device("cpu")
    if wanted != "cuda":
        raise HostUnfit(f"unknown device {wanted!r}")
    if not torch.cuda.is_available():
        raise HostUnfit(f"--device cuda asked for, but {why_no_cuda(torch)}; not training on the CPU instead")
    return torch.device("cuda")


def why_no_cuda(torch: Any) -> str:
    built_with = torch.version.cuda
    if built_with is None:
        return f"torch {torch.__version__} is a build without CUDA"
    count = torch.cuda.device_count()
    return (f"torch {torch.__version__} (CUDA {built_with}) sees {count} CUDA device(s): no driver, no GPU,"
            f" or CUDA_VISIBLE_DEVICES hides it")
