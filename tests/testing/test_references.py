"""The float64 references themselves: a check is only as exact as its reference."""

from __future__ import annotations

import torch
import transformers

from leanbp.models import tiny_config
from leanbp.testing import full_precision_norms


def _norm_error(norm) -> float:
    """Relative error of ``norm`` on float64 rows against RMSNorm computed in float64."""
    x = torch.randn(4, norm.weight.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 3
    exact = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight
    return ((norm(x) - exact).norm() / exact.norm()).item()


def test_full_precision_norms_survive_a_train_eval_switch_of_a_loaded_model(tmp_path):
    """transformers re-kernelizes a model that ``from_pretrained`` loaded on each train()/eval()
    switch (with the ``kernels`` package, as GRPO's generate-then-train loop does it), which drops
    instance forwards of its norms; the float64 norms must stay, and go when the block ends."""
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3"), dtype=torch.float64).save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    norm = model.model.layers[0].input_layernorm
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)
    stock = type(norm)
    assert _norm_error(norm) > 1e-10  # transformers' norm rounds to float32: what the patch is for
    with full_precision_norms(model), torch.no_grad():
        for mode in (True, False, True):
            model.train(mode)
            assert _norm_error(norm) < 1e-15, f"after train({mode})"
            assert isinstance(norm, stock)
    assert type(norm) is stock
    assert _norm_error(norm) > 1e-10
