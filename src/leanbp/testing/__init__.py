"""Public helpers for checking leanbp, as ``torch.testing`` is for PyTorch: the float64 references
(``_references.py``), ``verify`` (behind ``leanbp verify``), random exactness cases for hypothesis
(``_cases.py``), fault injection of ``leanbp train`` (``_faults.py``), and the distributed
conformance check that a torchrun launch runs on every engine (``conformance``: the worker and its
settings)."""

from ._cases import ExactCase, case_batch, case_model, check_case, exact_cases
from ._faults import KILL_TARGETS, FaultReport, descendants, fingerprint, kill_and_resume, run_to_completion
from ._references import (exact_trl_head, full_precision_norms, patch_full_precision_norms, plain_step,
                          randomize_for_checks, reference_causal_lm_loss, reference_load_balancing_loss,
                          relative_errors, streamed_step, streamed_vs_plain)
from ._verify import BOUNDARY_CHUNKINGS, group_of, verify

__all__ = ["BOUNDARY_CHUNKINGS", "ChunkCounter", "CollectiveCounter", "ENGINES", "ExactCase", "FaultReport",
           "HF_ENGINES", "KILL_TARGETS", "case_batch", "case_model", "check_case", "descendants", "exact_cases", "exact_trl_head", "fingerprint",
           "full_precision_norms", "group_of", "kill_and_resume", "patch_full_precision_norms", "randomize_for_checks",
           "plain_step", "reference_causal_lm_loss", "reference_load_balancing_loss", "relative_errors", "run_conformance",
           "run_to_completion", "streamed_step", "streamed_vs_plain", "verify"]

# what the conformance worker module offers, imported on first use: torchrun runs that module as
# ``python -m leanbp.testing.conformance``, which must not find it imported already
_CONFORMANCE = ("ENGINES", "HF_ENGINES", "ChunkCounter", "CollectiveCounter", "run_conformance")


def __getattr__(name: str):
    if name in _CONFORMANCE:
        from . import conformance

        return getattr(conformance, name)
    raise AttributeError(f"module 'leanbp.testing' has no attribute {name!r}")
