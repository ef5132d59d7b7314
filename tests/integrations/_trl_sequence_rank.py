"""One rank of ``test_trl_sequence_parallel.py``'s torchrun launch: every case of TRL's trainers
with ``stream_trainer(trainer, sequence_parallel=True)``; each rank saves its gradients per step and
its final parameters to ``OUT/<case>/rank<r>.pt`` (or the error it met, ``rank<r>.error``); then
each rank calls a whole-sequence model with its own input ids and writes the refusal it met to
``OUT/refusal/rank<r>.txt``."""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (the cases of test_trl.py)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # (tests/: conftest)

import test_trl  # noqa: E402
from test_trl_sequence_parallel import CASES, run_case  # noqa: E402

import leanbp  # noqa: E402
from leanbp.streaming import state_of  # noqa: E402


def _record_splits(splits: list) -> None:
    """(whole rows, rows the streamed layers ran on) of every whole-sequence call: the proof that
    each rank ran only its share."""
    from leanbp.engine import StreamedLayerFunction
    from leanbp.streaming import _forwards

    whole_inputs, apply = _forwards._whole_inputs, StreamedLayerFunction.apply

    def whole(state, arguments):
        splits.append([arguments["input_ids"].shape[1], None])
        return whole_inputs(state, arguments)

    def layer(hidden, *rest):
        if splits and splits[-1][1] is None:
            splits[-1][1] = hidden.shape[1]
        return apply(hidden, *rest)

    _forwards._whole_inputs = whole
    StreamedLayerFunction.apply = layer


def main(out: str) -> None:
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    # (a case whose policy is saved and reloaded waits for rank 0's files before its trainer exists;
    # accelerate takes this group over)
    torch.distributed.init_process_group("gloo")
    splits = []
    _record_splits(splits)
    for name in CASES:
        folder = Path(out, name)
        folder.mkdir(parents=True, exist_ok=True)
        try:
            splits.clear()
            grads, params = run_case(name, folder / f"run{rank}", sequence_parallel=True)
            torch.save({"grads": grads, "params": params, "splits": list(splits)}, folder / f"rank{rank}.pt")
        except Exception:  # (every rank meets the same error in step; the next case still runs)
            (folder / f"rank{rank}.error").write_text(traceback.format_exc())
            raise
    _refusal(Path(out, "refusal"), rank)
    _labels_call(Path(out, "labels"), rank)


def _labels_call(folder: Path, rank: int) -> None:
    """A whole-sequence call with labels (transformers' Trainer's call), T = 13 (padded to 14) with
    left padding: the loss, and the gradients averaged over the ranks as DDP does, against the same
    model streamed in this process without sequence parallelism."""
    import copy

    import torch.distributed as dist

    from leanbp.testing import full_precision_norms, relative_errors

    folder.mkdir(parents=True, exist_ok=True)
    model = test_trl.tiny_model()
    reference = copy.deepcopy(model)
    leanbp.stream(model, sequence_parallel=True, **test_trl.CHUNKS)
    state_of(model).whole_sequences = True
    leanbp.stream(reference, **test_trl.CHUNKS)
    ids = torch.randint(5, 256, (2, 13), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    labels = ids.masked_fill(mask == 0, -100)
    with full_precision_norms(model, reference):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        expected = reference(input_ids=ids, attention_mask=mask, labels=labels).loss
        expected.backward()
    for param in model.parameters():  # (as DDP averages them)
        dist.all_reduce(param.grad)
        param.grad /= dist.get_world_size()
    worst = max(relative_errors(reference, model).values())
    (folder / f"rank{rank}.txt").write_text(f"{abs(loss.item() - expected.item()) / abs(expected.item())} {worst}")


def _refusal(folder: Path, rank: int) -> None:
    """A whole-sequence call whose ranks hold different sequences (as when each rank sampled its own
    completions) must fail on every rank, not train on a mixture."""
    folder.mkdir(parents=True, exist_ok=True)
    model = test_trl.tiny_model()
    leanbp.stream(model, sequence_parallel=True, **test_trl.CHUNKS)
    state_of(model).whole_sequences = True  # (as stream_trainer sets it)
    ids = torch.arange(8).unsqueeze(0) + rank
    try:
        model(input_ids=ids, labels=ids)
        message = "no error"
    except ValueError as e:
        message = str(e)
    (folder / f"rank{rank}.txt").write_text(message)


if __name__ == "__main__":
    main(sys.argv[1])
