"""Checkpoints of `leanbp train` that no crash can lose, and the run they belong to.

    OUT/run.json                          the run's configuration (what --resume must match)
    OUT/checkpoints/step-00000020/        config, weights, optimizer.pt, trainer_state.json, COMPLETE
    OUT/checkpoint -> checkpoints/step-00000020    a symlink to the newest, swapped atomically
    OUT/final/                            a transformers checkpoint, when the engine saves in its own
                                          format (FSDP2: dcp/, DeepSpeed: deepspeed/ in each step-*)

A checkpoint is written into a temporary folder, every file is fsync'ed, a ``COMPLETE`` marker is
written last, and only then is the folder renamed into place and the pointer swapped (a new
symlink renamed over the old one). Whenever the process dies, the newest folder with a
``COMPLETE`` marker is a whole checkpoint: ``latest`` returns it, whatever state the pointer or
half-written folders are in. The newest ``keep`` checkpoints are kept. With several processes,
each writes its part into the temporary folder (``begin``), and one makes it whole (``finish``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

FOLDER = "checkpoints"
POINTER = "checkpoint"
MARKER = "COMPLETE"
RUN = "run.json"
LOG = "train_log.csv"
FINAL = "final"  # the transformers checkpoint exported at the end by engines that save in their own format
# what a later --resume may change (the chunk sizes only trade memory for speed: the gradients are
# the same); every other setting must be the run's
RESUMABLE_CHANGES = ("steps", "save_every", "keep", "device", "resume", "overwrite", "skip_nonfinite", "chunk_size",
                     "head_chunk_size", "chunk_memory")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            _fsync(path)
    _fsync(folder)


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` by ``text``: a crash leaves the old or the new file, never a torn one."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync(path.parent)


def _step_of(folder: Path) -> int:
    return int(folder.name.split("-")[1])


def complete(out: Path) -> list[Path]:
    """Whole checkpoints, oldest first."""
    root = out / FOLDER
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step-*") if p.is_dir() and (p / MARKER).exists()]
    return sorted(found, key=_step_of)


def latest(out: Path) -> Path | None:
    found = complete(out)
    return found[-1] if found else None


def save(out: Path, step: int, write, keep: int = 2) -> Path:
    """``write(folder)`` the checkpoint of ``step``, make it durable, point at it, prune old ones."""
    tmp = begin(out, step)
    write(tmp)
    return finish(out, step, tmp, keep)


def begin(out: Path, step: int) -> Path:
    """An empty temporary folder for the checkpoint of ``step`` (several processes may write into
    it before one calls ``finish``)."""
    (out / FOLDER).mkdir(parents=True, exist_ok=True)
    tmp = temp_folder(out, step)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def temp_folder(out: Path, step: int) -> Path:
    return out / FOLDER / f".step-{step:08d}.tmp"


def finish(out: Path, step: int, tmp: Path, keep: int = 2) -> Path:
    """Make the written folder durable and whole, rename it into place, point at it, prune."""
    root = out / FOLDER
    final = root / f"step-{step:08d}"
    _fsync_tree(tmp)
    write_atomic(tmp / MARKER, f"{step}\n")  # last: the folder is whole from here on
    if final.exists():  # the same step saved again (a resume that ended where it began)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(root)
    _point(out, final)
    for old in complete(out)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".step-*.tmp"):  # left by a crash mid-write
        shutil.rmtree(stale, ignore_errors=True)
    return final


def _point(out: Path, target: Path) -> None:
    pointer, tmp = out / POINTER, out / f".{POINTER}.tmp"
    if pointer.is_dir() and not pointer.is_symlink():  # a real folder (an older leanbp): superseded
        shutil.rmtree(pointer)
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(os.path.relpath(target, out), tmp)
    os.replace(tmp, pointer)
    _fsync(out)


def has_run(out: Path) -> bool:
    return any((out / name).exists() or (out / name).is_symlink()
               for name in (RUN, FOLDER, POINTER, LOG, FINAL, "trainer"))


def clear_run(out: Path) -> None:
    """Remove a previous run's files from ``out`` (only the ones leanbp writes)."""
    for name in (FOLDER, "trainer"):
        shutil.rmtree(out / name, ignore_errors=True)
    shutil.rmtree(out / FINAL, ignore_errors=True)
    for name in (RUN, POINTER, LOG, "loss.png", f".{POINTER}.tmp"):
        path = out / name
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)


def check_resumable(saved: dict, config: dict) -> None:
    """A --resume must continue the same run: only ``RESUMABLE_CHANGES`` may differ."""
    changed = {k: (saved.get(k), v) for k, v in config.items()
               if k not in RESUMABLE_CHANGES and k in saved and saved[k] != v}
    if changed:
        detail = ", ".join(f"{k}: run has {a!r}, now {b!r}" for k, (a, b) in sorted(changed.items()))
        raise ValueError(f"--resume continues the run in this folder with its own settings; changed: {detail}. "
                         "Use another --out for a new run.")


def read_run(out: Path) -> dict | None:
    path = out / RUN
    return json.loads(path.read_text()) if path.exists() else None
