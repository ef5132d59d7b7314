"""Timing a step on any device: a GPU's work is queued, so a timer waits for it first."""

from __future__ import annotations

import torch


def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has done the work queued on it (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
