"""Zeroth-order fine-tuning: DPZero, differentially private training with two forwards per step
and no backward (memory of inference: no activations kept, no gradients, no optimizer state).

    _directions.py  Direction: a Gaussian z over the trainable parameters, regenerated from a seed
    _losses.py      example_losses: per-example losses without autograd (streamed: no full logits)
    _dpzero.py      finite_differences (the estimator) and DPZero (clip, noise, update)
    _privacy.py     the accountant (Opacus's RDP, an optional dependency: '.[dp]'), and the secure
                    randomness that noise and Poisson sampling need

``leanbp train --optimizer dpzero`` runs it on a model and data of its own; this package is the
method, usable on any causal LM.
"""

from ._directions import Direction, mix, trainable_parameters
from ._dpzero import DPZero, DPZeroConfig, DPZeroStep, finite_differences
from ._losses import example_losses
from ._privacy import ACCOUNTANT, PrivacyAccountant, SecureRandom, SeededRandom, noise_multiplier

__all__ = ["ACCOUNTANT", "DPZero", "DPZeroConfig", "DPZeroStep", "Direction", "PrivacyAccountant", "SecureRandom",
           "SeededRandom", "example_losses", "finite_differences", "mix", "noise_multiplier", "trainable_parameters"]
