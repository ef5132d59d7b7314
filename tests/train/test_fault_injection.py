"""kill -9 at random moments of `leanbp train` (starting, training, writing checkpoints), then
--resume: the final weights and the loss log equal an uninterrupted run, bit for bit.
(benchmarks/fault_injection.py runs more kills.)"""

from __future__ import annotations

import random

from leanbp.testing import fingerprint, kill_and_resume, run_to_completion

ARGS = ["train", "--seq-len", "48", "--chunk-size", "16", "--steps", "10", "--save-every", "1", "--lr", "3e-3"]


def test_kill_and_resume_is_bit_identical(tmp_path):
    run_to_completion([*ARGS, "--out", str(tmp_path / "reference")])
    report = kill_and_resume(ARGS, tmp_path / "faulted", kills=5, max_delay_s=8.0, rng=random.Random(7))
    assert report.kills == 5 and report.kills_in_checkpoint_writes >= 1
    assert fingerprint(tmp_path / "faulted") == fingerprint(tmp_path / "reference")
