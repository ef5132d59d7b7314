"""Approx-BP (ReGELU2/ReSiLU2), Inverted Activations, and MS-BP (memory-sharing norms with folded
affines)."""

from ._activations import (REGELU2, RESILU2, ReGELU2, ReSiLU2, pack_2bit, regelu2, resilu2, saved_bytes,
                           step_codes, swiglu2, unpack_2bit)
from ._inverted import (InvertedActivation, derivative_error, inverse_fit, inverted_activation,
                        inverted_saved_bytes)
from ._norms import MSLayerNorm, MSRMSNorm, ms_layer_norm, ms_rms_norm
from ._patch import (ACTIVATION_MODES, VARIANTS, approx, is_approximated, unapprox, unfolded_state_dict,
                     variant_settings)

__all__ = [
    "ACTIVATION_MODES", "InvertedActivation", "derivative_error", "inverse_fit", "inverted_activation",
    "inverted_saved_bytes",
    "REGELU2", "RESILU2", "ReGELU2", "ReSiLU2", "MSLayerNorm", "MSRMSNorm", "approx", "is_approximated",
    "ms_layer_norm", "ms_rms_norm", "pack_2bit", "regelu2", "resilu2", "saved_bytes", "step_codes",
    "swiglu2", "unapprox", "unfolded_state_dict", "unpack_2bit", "VARIANTS", "variant_settings",
]
