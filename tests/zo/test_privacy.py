"""DPZero's privacy: the noise multiplier is Opacus's for (epsilon, delta, steps, rate), the epsilon
reported after T steps is at most the target and agrees with Opacus's accountant stepped T times,
the RDP bound is conservative against the exact Gaussian mechanism, one example moves the
released sum by at most C, the noise has the stated scale, and the secure sampler samples at rate q."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from leanbp.zo import (DPZero, DPZeroConfig, PrivacyAccountant, SecureRandom, SeededRandom, noise_multiplier)

opacus = pytest.importorskip("opacus", reason="needs the dp extra (pip install -e '.[dp]')")


@pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha")  # (Opacus's own search, called here)
@pytest.mark.parametrize("epsilon, delta, steps, rate", [(8.0, 1e-5, 300, 16 / 1618), (2.0, 1e-6, 1000, 0.01),
                                                          (1.0, 1e-5, 3, 0.5)])
def test_the_noise_multiplier_is_opacus_and_the_epsilon_after_the_run_is_at_most_the_target(epsilon, delta, steps,
                                                                                             rate):
    from opacus.accountants import RDPAccountant
    from opacus.accountants.utils import get_noise_multiplier

    sigma = noise_multiplier(epsilon, delta, steps, rate)
    assert sigma == get_noise_multiplier(target_epsilon=epsilon, target_delta=delta, sample_rate=rate, steps=steps,
                                         accountant="rdp", epsilon_tolerance=0.01)
    accountant = PrivacyAccountant(sigma, rate, delta)
    spent = accountant.epsilon(steps)
    assert epsilon - 0.01 <= spent <= epsilon
    # the same number as Opacus's accountant stepped once per step (its own composition)
    reference = RDPAccountant()
    for _ in range(steps):
        reference.step(noise_multiplier=sigma, sample_rate=rate)
    assert spent == pytest.approx(reference.get_epsilon(delta=delta), rel=1e-12)
    # more steps spend more; none spend nothing; a little less noise would overspend
    assert accountant.epsilon(0) == 0 < accountant.epsilon(1) < accountant.epsilon(steps // 2 + 1) <= spent
    assert PrivacyAccountant(sigma * 0.97, rate, delta).epsilon(steps) > epsilon - 0.01
    # where a run stops: the last step within the budget
    last = accountant.max_steps(epsilon)
    assert last >= steps and accountant.epsilon(last) <= epsilon < accountant.epsilon(last + 1)


def _exact_gaussian_delta(epsilon: float, mu: float) -> float:
    """The exact delta(epsilon) of a Gaussian mechanism with sensitivity / std = mu (Balle & Wang
    2018, Theorem 8); T compositions of sigma are one mechanism with mu = sqrt(T) / sigma."""
    phi = lambda x: 0.5 * math.erfc(-x / math.sqrt(2))  # noqa: E731
    return phi(-epsilon / mu + mu / 2) - math.exp(epsilon) * phi(-epsilon / mu - mu / 2)


@pytest.mark.parametrize("steps, sigma", [(10, 4.0), (300, 20.0), (1, 1.0)])
def test_the_accountant_is_conservative_and_not_far_off_without_subsampling(steps, sigma):
    """q = 1: T steps of N(0, (sigma C)^2) on a sum of sensitivity C are exactly a Gaussian
    mechanism with mu = sqrt(T) / sigma. The epsilon the accountant reports must be at least the
    exact one (its delta at that epsilon is <= the target) and, RDP being near-tight here, within
    40% of it."""
    delta = 1e-5
    spent = PrivacyAccountant(sigma, 1.0, delta).epsilon(steps)
    mu = math.sqrt(steps) / sigma
    assert _exact_gaussian_delta(spent, mu) <= delta
    lo, hi = 0.0, spent  # the exact epsilon: bisection on the exact, decreasing delta(epsilon)
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _exact_gaussian_delta(mid, mu) > delta else (lo, mid)
    assert spent <= 1.4 * hi


def test_one_example_moves_the_released_sum_by_at_most_the_clip():
    """Add/remove one example, whatever its loss (huge, infinite, NaN): with the same noise draw,
    S = sum clip_C(d_i) + noise changes by at most C, so S / L by at most C / L."""
    C, L, mu = 0.5, 4.0, 1e-3
    params = [torch.zeros(5, dtype=torch.float64, requires_grad=True)]
    base = torch.tensor([0.1, -3.0, 7.0], dtype=torch.float64)
    config = DPZeroConfig(mu=mu, clip=C, noise_multiplier=1.3, expected_batch_size=L, nonfinite="zero")

    def scalar(extra: list[float]) -> float:
        with torch.no_grad():
            params[0].zero_()
        values = torch.cat([base, torch.tensor(extra, dtype=torch.float64)])
        z = DPZero(params, config).direction(0)
        w = z.tensor(0)
        # losses linear along z with slopes ``values``: d_i = values_i (exactly, up to rounding)
        losses = lambda: values * (params[0].detach() * w).sum() / (w * w).sum()  # noqa: E731
        return DPZero(params, config, SeededRandom(5)).step(losses, lr=0.0, step=0).scalar

    without = scalar([])
    for extra in (1e9, -1e9, 0.3, float("inf"), float("nan")):
        moved = abs(scalar([extra]) - without)
        assert moved <= C / L + 1e-12, extra
    assert abs(scalar([1e9]) - without) == pytest.approx(C / L)  # (the clip binds)


def test_the_noise_is_sigma_c_over_the_expected_batch_and_only_drawn_from_the_randomness_given():
    params = [torch.zeros(3, dtype=torch.float64, requires_grad=True)]
    config = DPZeroConfig(mu=1e-3, clip=0.7, noise_multiplier=2.5, expected_batch_size=8.0)
    zero = lambda: torch.zeros(2, dtype=torch.float64)  # noqa: E731  (d = 0: the scalar is the noise alone)
    for step in range(3):
        got = DPZero(params, config, SeededRandom(11)).step(zero, lr=0.0, step=step).scalar
        assert got == SeededRandom(11).normal(2.5 * 0.7, step) / 8.0
    # the default draws from the OS's CSPRNG: two optimizers, two different draws
    a = DPZero(params, config).step(zero, lr=0.0, step=0).scalar
    b = DPZero(params, config).step(zero, lr=0.0, step=0).scalar
    assert a != b and isinstance(DPZero(params, config).randomness, SecureRandom)
    assert SecureRandom.private and not SeededRandom.private


def test_the_secure_randomness_has_the_stated_distributions():
    rng = SecureRandom()
    draws = torch.tensor([rng.normal(3.0, 0) for _ in range(20000)], dtype=torch.float64)
    assert abs(draws.mean()) < 6 * 3.0 / math.sqrt(20000)
    assert abs(draws.std() / 3.0 - 1) < 6 / math.sqrt(2 * 20000)
    u = rng.uniform(200000, 0)
    assert u.dtype == torch.float64 and 0 <= u.min() and u.max() < 1
    assert abs(u.mean() - 0.5) < 6 * math.sqrt(1 / 12 / 200000)
    records, rate = 200000, 0.01
    picks = rng.poisson(records, rate, 0)
    expected, sd = records * rate, math.sqrt(records * rate * (1 - rate))
    assert abs(picks.numel() - expected) < 6 * sd
    assert picks.unique().numel() == picks.numel() and int(picks.max()) < records
    assert not torch.equal(rng.poisson(records, rate, 0), picks)  # (fresh every time)
    assert torch.equal(SeededRandom(3).poisson(records, rate, 9), SeededRandom(3).poisson(records, rate, 9))


def test_settings_that_cannot_be_private_are_refused():
    with pytest.raises(ValueError, match="finite clip"):
        DPZeroConfig(clip=float("inf"), noise_multiplier=1.0)
    with pytest.raises(ValueError, match="delta"):
        noise_multiplier(8.0, 0.0, 10, 0.1)
    with pytest.raises(ValueError, match="sampling rate"):
        noise_multiplier(8.0, 1e-5, 10, 1.5)
    with pytest.raises(ValueError, match="no noise multiplier reaches epsilon"):
        noise_multiplier(1e-9, 1e-12, 10**6, 1.0)


def test_without_opacus_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "opacus.accountants", None)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[dp\]'"):
        noise_multiplier(8.0, 1e-5, 10, 0.1)
