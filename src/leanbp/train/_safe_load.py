"""Loading what a run folder holds without running what it might carry.

A checkpoint can come from elsewhere (a shared disk, a download), and Python's pickle, which
``torch.save`` and the checkpoint formats of DCP and DeepSpeed use, calls whatever a file names.
Every file ``--resume`` reads is therefore unpickled with an allowlist: tensors and plain data
(``torch.load(weights_only=True)``), plus the few classes each format is known to store. A file
that names anything else is refused with ``UnsafeCheckpointError`` before any of it runs.

    optimizer.pt (single, ddp)   torch.load(weights_only=True)
    dcp/ (fsdp2)                 .metadata through an allowlist; each non-tensor item (the
                                 optimizer's param_groups) through torch.load(weights_only=True)
    deepspeed/ (zero2, zero3)    DeepSpeed's checkpoint engine made to load with
                                 weights_only=True and the three DeepSpeed classes it stores

(``torch>=2.6``: before it, ``weights_only=True`` could be bypassed, CVE-2025-32434.) TRL's
trainer checkpoints are read by transformers' ``Trainer``, which passes ``weights_only=True``
itself; weights are read from safetensors by ``from_pretrained``.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path

import torch


class UnsafeCheckpointError(ValueError):
    """A checkpoint file names code to call, not only tensors and plain data."""


def _refused(path, detail: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{path}: refused to load: it holds a pickled object other than tensors and plain data ({detail}), "
        "unpickling it could run code. Resume only from a run folder written by leanbp (or a copy you trust).")


def _reason(error: Exception) -> str:
    """What the file asked for, from torch's weights-only message or our unpickler's."""
    found = re.search(r"Unsupported global: (?:GLOBAL )?([\w.]+)", str(error))
    return f"it names {found.group(1)}" if found else str(error).splitlines()[0]


def load_tensors(source, map_location=None, allowed: tuple = (), name: str | None = None):
    """``torch.load(source, weights_only=True)``, with the classes ``allowed`` also accepted;
    ``UnsafeCheckpointError`` for a file that names anything else."""
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(source, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise _refused(name or source, _reason(e)) from None


# -- torch.distributed.checkpoint (FSDP2) -------------------------------------------------------

def _dcp_metadata_classes() -> dict[tuple[str, str], object]:
    import pathlib

    from torch.distributed.checkpoint import filesystem, metadata

    allowed = {("torch", "Size"): torch.Size,
               # a layout by its name (torch.strided), as torch's own weights-only unpickler allows
               ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
               ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): filesystem._StorageInfo}
    for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                 "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"):
        if hasattr(metadata, name):
            allowed[("torch.distributed.checkpoint.metadata", name)] = getattr(metadata, name)
    for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
        allowed[("pathlib", name)] = getattr(pathlib, name)
    return allowed


class _DcpMetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a plain pickle of its own dataclasses; only those (and dtypes, sizes,
    paths) may be named."""

    def __init__(self, file):
        super().__init__(file)
        self._allowed = _dcp_metadata_classes()

    def find_class(self, module: str, name: str):
        found = self._allowed.get((module, name))
        if found is None and module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            found = getattr(torch, name)  # a tensor's dtype (torch.float32 & co.)
        if found is None:
            raise pickle.UnpicklingError(f"Unsupported global: {module}.{name}")
        return found


def load_dcp(state: dict, folder: Path) -> None:
    """``torch.distributed.checkpoint.load(state, folder)``, refusing a checkpoint whose
    ``.metadata`` names anything but DCP's metadata classes (DCP unpickles it with no allowlist)
    or whose non-tensor items (the optimizer's param_groups, unpickled with ``weights_only=False``)
    do not load with ``weights_only=True``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    path = Path(folder) / ".metadata"
    try:
        with open(path, "rb") as f:
            _DcpMetadataUnpickler(f).load()
    except FileNotFoundError:
        raise FileNotFoundError(f"no DCP checkpoint in {folder} (its .metadata is missing)") from None
    except pickle.UnpicklingError as e:
        raise _refused(path, _reason(e)) from None
    try:
        dcp.load(state, checkpoint_id=str(folder), planner=_safe_dcp_planner())
    except CheckpointException as e:  # (DCP wraps what a rank raised, as a BaseException)
        refused = next((exc for exc, _ in e.failures.values() if isinstance(exc, UnsafeCheckpointError)), None)
        if refused is not None:
            raise refused from None
        raise


def _safe_dcp_planner():
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            data = value.read()
            load_tensors(io.BytesIO(data), name=f"DCP item {read_item.dest_index.fqn!r}")  # (raises, or it is safe)
            super().load_bytes(read_item, io.BytesIO(data))

    return SafeLoadPlanner()


# -- DeepSpeed (ZeRO-2/3) -----------------------------------------------------------------------

def _deepspeed_classes() -> tuple:
    """What DeepSpeed 0.19's ZeRO checkpoints store besides tensors and plain data (found by
    reading the pickles of ZeRO-2 and ZeRO-3 checkpoints of ``leanbp train``)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return LossScaler, ZeroStageEnum, fragment_address


def load_deepspeed_safely(engine) -> None:
    """Make the DeepSpeed engine's checkpoint engine (through which it reads every file of a
    checkpoint) load with ``weights_only=True`` (it passes ``weights_only=False``)."""
    allowed = _deepspeed_classes()

    def load(path, map_location=None):
        return load_tensors(path, map_location=map_location, allowed=allowed)

    engine.checkpoint_engine.load = load


__all__ = ["UnsafeCheckpointError", "load_dcp", "load_deepspeed_safely", "load_tensors"]
