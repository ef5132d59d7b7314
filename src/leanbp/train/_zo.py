"""``leanbp train --optimizer dpzero``: DPZero's steps (``leanbp.zo``) inside the training loop.

    a step t = a Poisson sample of the data's N records (each in with probability q = L / N,
               L = --batch-size x --grad-accum, drawn from the OS's CSPRNG)
               -> micro-batches of at most --batch-size rows, cut to their longest row
               -> DPZero: two forwards over all of them at theta +/- mu z_t, clip, noise, update
               -> epsilon after t + 1 steps (Opacus's RDP accountant)

The run's privacy is fixed when it starts: sigma is the smallest noise multiplier whose epsilon
after --steps steps is at most --dp-epsilon at delta, for the sampling rate q. It is kept with
the loop's state (trainer_state.json: ``privacy``), so a resumed run continues the same accounting
and a longer --steps buys no budget: the run stops, saying so, before a step that would spend
more than --dp-epsilon. The directions' seeds are (--seed, step), so a resumed run draws the
directions an uninterrupted one would. The noise and the samples are not reproducible, on purpose
(``leanbp.zo._privacy`` says why).

The loss logged per step is the sampled batch's mean loss, computed from the raw batch: it is for
watching the run, not covered by the guarantee, and not to be published.
"""

from __future__ import annotations

import time

import torch
from torch import nn
from tqdm import tqdm

from ..memory import track
from ..zo import DPZero, DPZeroConfig, PrivacyAccountant, SecureRandom, example_losses, noise_multiplier
from ._config import NonFiniteError, TrainConfig
from ._data import TokenData
from ._outputs import StepResult


def default_delta(records: int) -> float:
    """delta well below 1 / N (a mechanism that publishes one record at random has delta = 1 / N)."""
    return min(1e-5, 1.0 / (10 * records))


class PrivateRun:
    """DPZero over ``model``'s trainable parameters on ``data``'s records, its privacy in
    ``state["privacy"]`` (set here for a new run, read back for a resumed one)."""

    def __init__(self, cfg: TrainConfig, model: nn.Module, data: TokenData, state: dict,
                 device: torch.device, randomness: SecureRandom | None = None):
        self.cfg, self.model, self.data, self.device = cfg, model, data, device
        self.randomness = randomness if randomness is not None else SecureRandom()
        records, expected = data.records, cfg.batch_size * cfg.grad_accum
        if expected > records:
            raise ValueError(f"--optimizer dpzero samples --batch-size x --grad-accum = {expected} records per step "
                             f"(expected), more than the {records} records of the data")
        privacy = state.get("privacy")
        if privacy is None:
            if state["step"] > 0:
                raise ValueError("--resume: this run was not trained with --optimizer dpzero (its state holds no "
                                 "privacy accounting)")
            rate = expected / records
            delta = cfg.dp_delta if cfg.dp_delta is not None else default_delta(records)
            sigma = noise_multiplier(cfg.dp_epsilon, delta, cfg.steps, rate)
            privacy = {"target_epsilon": cfg.dp_epsilon, "delta": delta, "noise_multiplier": sigma,
                       "sample_rate": rate, "records": records, "expected_batch_size": expected,
                       "budgeted_steps": cfg.steps, "sampling": "poisson", "accountant": "opacus rdp",
                       "epsilon": 0.0}
            state["privacy"] = privacy
        elif privacy["records"] != records:
            raise ValueError(f"--resume: the data has {records} records now, {privacy['records']} when the run "
                             "began; its privacy accounting holds for that data only")
        self.privacy = privacy
        self.accountant = PrivacyAccountant(privacy["noise_multiplier"], privacy["sample_rate"], privacy["delta"])
        config = DPZeroConfig(mu=cfg.zo_mu, clip=cfg.dp_clip, noise_multiplier=privacy["noise_multiplier"],
                              expected_batch_size=privacy["expected_batch_size"], seed=cfg.seed,
                              nonfinite="zero" if cfg.skip_nonfinite else "raise")
        self.optimizer = DPZero(model, config, self.randomness)

    def budget_spent(self, step: int) -> str | None:
        """Why step ``step`` (0-based) may not run: it would spend more than the target epsilon."""
        after = self.accountant.epsilon(step + 1)
        target = self.privacy["target_epsilon"]
        if after <= target:
            return None
        return (f"privacy budget reached: epsilon {self.accountant.epsilon(step):.4f} of {target:g} spent after "
                f"{step} steps (delta {self.privacy['delta']:.2e}); step {step + 1} would spend {after:.4f}, so the "
                "run stops here")

    def step(self, step: int, lr: float) -> StepResult:
        """Step ``step`` (0-based) at learning rate ``lr``."""
        cfg, p = self.cfg, self.privacy
        picks = self.randomness.poisson(p["records"], p["sample_rate"], step).tolist()
        batches = [self.data.rows(picks[i: i + cfg.batch_size]) for i in range(0, len(picks), cfg.batch_size)]

        def losses() -> torch.Tensor:  # (B,) over every micro-batch
            if not batches:
                return torch.zeros(0, dtype=torch.float64)
            return torch.cat([example_losses(self.model, b["input_ids"].to(self.device), b["labels"].to(self.device),
                                             b["attention_mask"].to(self.device)).cpu() for b in batches])

        t0 = time.perf_counter()
        try:
            with track(self.model, device=self.device) as mem:
                result = self.optimizer.step(losses, lr, step)
        except FloatingPointError as e:
            raise NonFiniteError(f"step {step + 1}: {e}. Stopped before the update: the weights and the last "
                                 "checkpoint are intact. Pass --skip-nonfinite to count such examples as 0 (which "
                                 "keeps the privacy guarantee).") from None
        seconds = time.perf_counter() - t0
        if result.nonfinite:
            tqdm.write(f"step {step + 1}: {result.nonfinite} examples' losses were not finite; each counted as 0 "
                       "(--skip-nonfinite)")
        epsilon = self.accountant.epsilon(step + 1)
        p["epsilon"] = epsilon
        tokens = sum(int(b["attention_mask"].sum()) for b in batches)
        report = mem.report.as_mib()
        return StepResult(loss=result.loss, lr=lr, tokens_per_s=tokens / seconds, peak_mib=report["peak"],
                          activation_mib=report["activations"], skip=None, epsilon=epsilon)


def privacy_summary(privacy: dict) -> str:
    """One line on what a run's privacy is (``state["privacy"]``)."""
    p = privacy
    return (f"privacy: epsilon {p['epsilon']:.4f} of {p['target_epsilon']:g} spent, delta {p['delta']:.2e} "
            f"(noise multiplier {p['noise_multiplier']:.4f}, Poisson sampling rate {p['sample_rate']:.4g} of "
            f"{p['records']} records, Opacus RDP accountant)")


__all__ = ["PrivateRun", "default_delta", "privacy_summary"]
