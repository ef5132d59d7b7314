"""The privacy of DPZero: what is released, how it is accounted, and the randomness it needs.

The mechanism. Each step t releases one number,

    S_t = sum_{i in B_t} clip_C(d_i) + N(0, (sigma C)^2),     clip_C(d) = min(max(d, -C), C)

where B_t is a Poisson sample of the N records (each record in independently with probability
q = L / N, L the expected batch size) and d_i is record i's loss difference along the step's
direction z_t. Everything else a step does is a function of S_t and of public values: z_t comes
from the run's seed and the step (it depends on no data), the update theta -= lr (S_t / L) z_t
divides by the *expected* size L, a constant (dividing by |B_t| would make the denominator depend
on who was sampled), and the learning rate follows a fixed schedule.

Sensitivity. Under add/remove-one adjacency (a neighbouring data set has one record more or
less), the sum changes by one clipped term: |clip_C(d_i)| <= C, so the L2 sensitivity of S_t is C
and N(0, (sigma C)^2) is the Gaussian mechanism with noise multiplier sigma. This needs every d_i to
depend on record i alone, which holds for a causal LM's per-example loss (``_losses.py``). A
non-finite d_i is set to 0 before the clip, which keeps the bound.

Accounting. T steps of the Poisson-subsampled Gaussian mechanism with (sigma, q) are composed by
Opacus's RDP accountant (Mironov, Talwar, Zhang 2019, "Renyi Differential Privacy of the Sampled
Gaussian Mechanism"; converted to (epsilon, delta) with Balle et al. 2020's bound). Opacus states
the same assumptions: Poisson sampling, add/remove adjacency. RDP gives an upper bound on
epsilon, so the guarantee is conservative (a PRV accountant would report a smaller epsilon for the
same run). ``noise_multiplier`` asks Opacus for the smallest sigma (to its search tolerance of
0.01 in epsilon) whose epsilon after T steps is at most the target.

What is guaranteed: the sequence of released S_t, hence every checkpoint, the final weights and
anything computed from them, is (epsilon, delta)-DP with respect to one record (one line of a
.jsonl, one example of ``builtin:classify``, one window of a text corpus). A person whose data
spans k records is protected by group privacy (about k epsilon). What is not covered: anything
computed from the raw batch outside S_t, such as the training loss ``leanbp train`` logs for you;
the data set's size N (treated as public); floating-point attacks on the noise sampler (Mironov
2012), which this sampler does not defend against.

Randomness. The noise and the Poisson sample must be unpredictable: noise an attacker can
regenerate from a seed (and ``--seed`` is written to run.json) hides nothing, and subsampling
amplifies privacy only while who was sampled stays secret. ``SecureRandom`` draws both from the
operating system's CSPRNG (``os.urandom``). ``SeededRandom`` draws them from a seed, reproducibly,
for tests and experiments only: it is NOT private.
"""

from __future__ import annotations

import math
import os
import random
import warnings

import torch

from ._directions import mix

ACCOUNTANT = "rdp"  # Opacus's RDP accountant: Poisson sampling, add/remove adjacency
EPSILON_TOLERANCE = 0.01  # Opacus's search tolerance: the epsilon reached is in [target - 0.01, target]
EXTRA = "dp"  # pip install -e '.[dp]'


def _opacus():
    """Opacus's accountant pieces, imported when first needed (an optional dependency)."""
    try:
        from opacus.accountants import RDPAccountant
        from opacus.accountants.utils import get_noise_multiplier
    except ImportError:
        raise ImportError("DPZero's privacy accounting needs Opacus: pip install -e '.[dp]' (or pip install "
                          "'opacus>=1.5')") from None
    return RDPAccountant, get_noise_multiplier


def _check(epsilon: float | None, delta: float, steps: int, sample_rate: float) -> None:
    if epsilon is not None and not (math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"epsilon must be a finite number > 0, got {epsilon}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if not 0 < sample_rate <= 1:
        raise ValueError(f"the sampling rate must be in (0, 1], got {sample_rate}")


def noise_multiplier(epsilon: float, delta: float, steps: int, sample_rate: float) -> float:
    """sigma such that ``steps`` Poisson-subsampled Gaussian steps at ``sample_rate`` spend at most
    (``epsilon``, ``delta``) by Opacus's RDP accountant."""
    _check(epsilon, delta, steps, sample_rate)
    _, get_noise_multiplier = _opacus()
    with warnings.catch_warnings():
        # ("optimal order is the largest alpha": said of the large sigmas the search tries first;
        # a bound from a narrower range of orders is larger, i.e. still an upper bound)
        warnings.simplefilter("ignore", UserWarning)
        try:
            return float(get_noise_multiplier(target_epsilon=epsilon, target_delta=delta, sample_rate=sample_rate,
                                              steps=steps, accountant=ACCOUNTANT,
                                              epsilon_tolerance=EPSILON_TOLERANCE))
        except ValueError as e:
            raise ValueError(f"no noise multiplier reaches epsilon {epsilon} at delta {delta} over {steps} steps at "
                             f"sampling rate {sample_rate:.4g} (Opacus: {e})") from None


class PrivacyAccountant:
    """(epsilon, delta) spent after a number of steps of the Poisson-subsampled Gaussian mechanism
    with ``noise_multiplier`` sigma and ``sample_rate`` q, by Opacus's RDP accountant.

    The state of a run is its step count: ``epsilon(steps)`` composes that many identical steps, so
    a resumed run continues its accounting from the step it resumes at."""

    def __init__(self, noise_multiplier: float, sample_rate: float, delta: float):
        _check(None, delta, 1, sample_rate)
        if not (math.isfinite(noise_multiplier) and noise_multiplier > 0):
            raise ValueError(f"the noise multiplier must be a finite number > 0, got {noise_multiplier}")
        self.noise_multiplier, self.sample_rate, self.delta = float(noise_multiplier), float(sample_rate), float(delta)
        self._cache: dict[int, float] = {}

    def epsilon(self, steps: int) -> float:
        """epsilon after ``steps`` steps (0 after none)."""
        if steps <= 0:
            return 0.0
        if steps not in self._cache:
            RDPAccountant, _ = _opacus()
            accountant = RDPAccountant()
            accountant.history = [(self.noise_multiplier, self.sample_rate, steps)]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # (as in noise_multiplier)
                self._cache[steps] = float(accountant.get_epsilon(delta=self.delta))
        return self._cache[steps]

    def max_steps(self, target_epsilon: float) -> int:
        """The most steps whose epsilon stays within ``target_epsilon``: a run stops there."""
        if self.epsilon(1) > target_epsilon:
            return 0
        lo, hi = 1, 2  # epsilon(lo) <= target; grow hi until it is over, then bisect
        while self.epsilon(hi) <= target_epsilon:
            lo, hi = hi, 2 * hi
            if hi > 2**40:
                raise ValueError(f"epsilon {target_epsilon} is never reached: sigma {self.noise_multiplier} is "
                                 "too large to account for")
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.epsilon(mid) <= target_epsilon else (lo, mid)
        return lo

    def as_dict(self) -> dict:
        return {"noise_multiplier": self.noise_multiplier, "sample_rate": self.sample_rate, "delta": self.delta,
                "accountant": f"opacus {ACCOUNTANT}"}


# -- randomness --------------------------------------------------------------------------------
class SecureRandom:
    """Noise and Poisson samples from the operating system's CSPRNG (``os.urandom``): nothing a
    seed, a log or a checkpoint could reproduce. ``step`` is ignored (every draw is fresh)."""

    private = True

    def __init__(self):
        self._system = random.SystemRandom()

    def normal(self, std: float, step: int) -> float:
        """One draw of N(0, std^2)."""
        return self._system.normalvariate(0.0, std)

    def uniform(self, n: int, step: int) -> torch.Tensor:
        """(n,) float64, uniform on [0, 1) with 53 random bits each."""
        if n == 0:
            return torch.zeros(0, dtype=torch.float64)
        bits = torch.frombuffer(bytearray(os.urandom(8 * n)), dtype=torch.int64)  # (n,)
        return (bits & (2**53 - 1)).double() * 2.0**-53

    def poisson(self, records: int, rate: float, step: int) -> torch.Tensor:
        """The indices of a Poisson sample: each of ``records`` in with probability ``rate``."""
        return (self.uniform(records, step) < rate).nonzero().squeeze(1)


class SeededRandom(SecureRandom):
    """Noise and samples drawn from (``seed``, step): reproducible, so NOT private. For tests and
    for experiments that must repeat bit for bit; never for data that needs protecting."""

    private = False

    def __init__(self, seed: int):
        super().__init__()
        self.seed = int(seed)

    def _generator(self, what: str, step: int) -> torch.Generator:
        return torch.Generator().manual_seed(mix(self.seed, what, step))

    def normal(self, std: float, step: int) -> float:
        return float(torch.randn((), generator=self._generator("noise", step), dtype=torch.float64)) * std

    def uniform(self, n: int, step: int) -> torch.Tensor:
        return torch.rand(n, generator=self._generator("sample", step), dtype=torch.float64)
