"""What a measurement ran on: every result file names it, since timings and their ratios differ
between CPUs (their vector extensions above all) and GPUs."""

from __future__ import annotations

import os
from pathlib import Path


def machine() -> dict:
    """What the timings ran on: CPU model, the vector extensions that change fp32/bf16 speed,
    cores, torch, and the GPU if one is visible."""
    import platform

    import torch

    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name in ("", platform.machine(), platform.processor()):
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    info = {"cpu": name, "cpu_flags": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags],
            "cores": os.cpu_count(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def describe_machine(info: dict) -> str:
    flags = ", ".join(info["cpu_flags"]) or "no avx2/avx512"
    gpu = f"; GPU {info['gpu']}" if "gpu" in info else ""
    return f"{info['cpu']} ({flags}), {info['cores']} cores, torch {info['torch']}{gpu}"
