"""DPZero (Zhang, Li, Thekumparampil, Oh, He, arXiv 2310.09639): differentially private
zeroth-order fine-tuning, with the memory of inference.

The estimator. For a loss l and a direction z ~ N(0, I) over the trainable parameters,

    d = (l(theta + mu z) - l(theta - mu z)) / (2 mu) = g . z + O(mu^2)         (g = grad l(theta))

is a central finite difference of the directional derivative (the error is (mu^2 / 6) times the
third derivative along z), and E_z[(g . z) z] = E[z z^T] g = g: d z is an unbiased estimate of the
gradient of l smoothed over a ball of radius ~mu (SPSA, as MeZO uses it). Two forwards and no
backward: no activations are kept for a backward, no gradient is stored, and z is never stored
either (``_directions.py``).

DPZero's step. With per-example losses l_i of a batch B (Poisson-sampled, ``_privacy.py``):

    d_i      = (l_i(theta + mu z) - l_i(theta - mu z)) / (2 mu)         per example, float64
    S        = sum_i clip_C(d_i) + N(0, (sigma C)^2)                     the only released number
    theta   -= lr * (S / L) * z                                          L: the expected batch size

Only the scalar d_i is clipped and noised, not a d-dimensional gradient, which is why DPZero's
rate is (nearly) independent of the model's size where DP-SGD's is not. With ``clip=inf`` and
``noise_multiplier=0`` the step is plain SPSA/MeZO on the batch mean (S / L = mean d_i when L is
the batch's size): not private, but what the estimator tests check.

The parameters go theta -> theta + mu z -> theta - mu z -> theta - lr (S / L) z: three passes over
z, the last one restoring and updating at once (``add_`` with mu - lr S / L). A forward that raises
leaves the parameters restored to theta before the error propagates.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from ._directions import Direction, mix, trainable_parameters
from ._privacy import SecureRandom

Losses = Callable[[], torch.Tensor]  # () -> (B,) per-example losses at the current parameters


def finite_differences(direction: Direction, losses: Losses, mu: float, restore: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d, losses at theta + mu z, losses at theta - mu z), each (B,) float64, with
    d_i = (l_i(theta + mu z) - l_i(theta - mu z)) / (2 mu).

    The parameters end at theta (``restore``), or at theta - mu z for a caller that folds the
    restore into its update (one pass over z fewer). ``losses`` must not draw random numbers
    (both calls must evaluate the same function)."""
    if not (math.isfinite(mu) and mu > 0):
        raise ValueError(f"mu must be a finite number > 0, got {mu}")
    offset = 0.0  # how far along z the parameters are now
    try:
        direction.add_(mu)
        offset = mu
        plus = losses().detach().double()  # (B,)
        direction.add_(-2 * mu)
        offset = -mu
        minus = losses().detach().double()  # (B,)
    except BaseException:
        direction.add_(-offset)  # (back to theta, up to rounding, before the error propagates)
        raise
    if plus.shape != minus.shape or plus.dim() != 1:
        direction.add_(mu)
        raise ValueError(f"losses() must return the same (B,) shape twice, got {tuple(plus.shape)} and "
                         f"{tuple(minus.shape)}")
    if restore:
        direction.add_(mu)
    return (plus - minus) / (2 * mu), plus, minus


@dataclass(frozen=True)
class DPZeroConfig:
    """The settings of a DPZero step.

    mu: the finite difference's step along z. clip: C, each example's difference is clipped to
    [-C, C] (its sensitivity). noise_multiplier: sigma, the noise is N(0, (sigma C)^2) on the sum
    (0: no noise, not private). expected_batch_size: L, the constant the noisy sum is divided by
    (with Poisson sampling, the sample rate times the number of records). seed: of the directions
    (public: z depends on no data). nonfinite: "raise" (restore theta and raise FloatingPointError)
    or "zero" (a non-finite d_i counts as 0, which keeps the sensitivity C) for an example whose
    loss is not finite at theta + mu z or theta - mu z.
    """

    mu: float = 1e-3
    clip: float = 1.0
    noise_multiplier: float = 0.0
    expected_batch_size: float = 1.0
    seed: int = 0
    nonfinite: str = "raise"

    def __post_init__(self):
        if not (math.isfinite(self.mu) and self.mu > 0):
            raise ValueError(f"mu must be a finite number > 0, got {self.mu}")
        if not (self.clip > 0) or math.isnan(self.clip):
            raise ValueError(f"clip must be > 0, got {self.clip}")
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0):
            raise ValueError(f"noise_multiplier must be a finite number >= 0, got {self.noise_multiplier}")
        if self.noise_multiplier > 0 and math.isinf(self.clip):
            raise ValueError("noise needs a finite clip: the noise is scaled by it (sigma * C)")
        if not (math.isfinite(self.expected_batch_size) and self.expected_batch_size > 0):
            raise ValueError(f"expected_batch_size must be a finite number > 0, got {self.expected_batch_size}")
        if self.nonfinite not in ("raise", "zero"):
            raise ValueError(f"nonfinite must be 'raise' or 'zero', got {self.nonfinite!r}")

    def direction_seed(self, step: int) -> int:
        return mix(self.seed, "direction", step)


@dataclass(frozen=True)
class DPZeroStep:
    """What one step did. ``loss``: the batch's mean loss at theta (the mean of the two forwards'
    losses, theta's to O(mu^2); nan for an empty batch) -- computed from the raw batch, so not
    private. ``scalar``: S / L, the released, noisy projected gradient the update used."""

    loss: float
    scalar: float
    examples: int
    clipped: int  # examples whose |d_i| exceeded C
    nonfinite: int  # examples whose difference was not finite (counted as 0)
    seed: int  # the direction's


class DPZero:
    """The DPZero optimizer over ``params`` (a module: its trainable parameters).

    >>> opt = DPZero(model, DPZeroConfig(mu=1e-3, clip=1.0, noise_multiplier=sigma, expected_batch_size=L))
    >>> opt.step(lambda: example_losses(model, **batch), lr=1e-4, step=t)

    ``randomness`` draws the noise (``SecureRandom``, the OS's CSPRNG, unless told otherwise)."""

    def __init__(self, params: nn.Module | Iterable[torch.Tensor], config: DPZeroConfig,
                 randomness: SecureRandom | None = None):
        self.params = trainable_parameters(params)
        self.config = config
        self.randomness = randomness if randomness is not None else SecureRandom()

    def direction(self, step: int) -> Direction:
        """Step ``step``'s direction z (the same for the same run seed and step, so a resumed run
        draws the directions an uninterrupted one would)."""
        return Direction(self.params, self.config.direction_seed(step))

    @torch.no_grad()
    def step(self, losses: Losses, lr: float, step: int) -> DPZeroStep:
        """One step at learning rate ``lr``: two forwards, clip, noise, update."""
        if not (math.isfinite(lr) and lr >= 0):
            raise ValueError(f"lr must be a finite number >= 0, got {lr}")
        cfg = self.config
        z = self.direction(step)
        d, plus, minus = finite_differences(z, losses, cfg.mu, restore=False)  # theta - mu z now
        finite = torch.isfinite(d)
        if not bool(finite.all()) and cfg.nonfinite == "raise":
            z.add_(cfg.mu)  # (theta again)
            raise FloatingPointError(f"the loss of {int((~finite).sum())} of {d.numel()} examples is not finite at "
                                     f"theta +/- mu z (mu = {cfg.mu}); the parameters are unchanged")
        d = torch.where(finite, d, torch.zeros_like(d))  # (a non-finite example adds 0: still within [-C, C])
        clipped = d.clamp(-cfg.clip, cfg.clip)  # (B,)
        total = float(clipped.sum())
        if cfg.noise_multiplier > 0:
            total += self.randomness.normal(cfg.noise_multiplier * cfg.clip, step)
        scalar = total / cfg.expected_batch_size
        z.add_(cfg.mu - lr * scalar)  # restore (+mu z) and update (-lr S / L z) in one pass
        mean = ((plus + minus) / 2)[finite]
        return DPZeroStep(loss=float(mean.mean()) if mean.numel() else float("nan"), scalar=scalar,
                          examples=d.numel(), clipped=int((d.abs() > cfg.clip).sum()),
                          nonfinite=int((~finite).sum()), seed=z.seed)
