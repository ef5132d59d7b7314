"""Encoder families that ``leanbp.approx`` patches but ``leanbp.stream`` does not (no causal LM):
their fold sites and activations only.

ViT (pre-LayerNorm): layernorm_before -> q/k/v, layernorm_after -> mlp.fc1, final layernorm ->
classifier. BERT / RoBERTa (post-LayerNorm): a norm's output feeds linears *and* the next residual
sum, so the residual branch gets gamma and beta back (``NormSite.residual``).
"""

from __future__ import annotations

from torch import nn

from ._base import NormSite


class _Encoder:
    """An ``ApproxRecipe`` (``models/_base.py``): fold sites and activations only."""

    def __init__(self, model: nn.Module):
        self.model = model

    def activation_name(self):
        return getattr(self.model.config, "hidden_act", None)


class VitRecipe(_Encoder):
    def _vit(self):
        return self.model.vit if hasattr(self.model, "vit") else self.model

    def norm_sites(self, notes):
        vit, sites = self._vit(), []
        for layer in vit.layers:
            attn = layer.attention
            sites.append(NormSite(layer, "layernorm_before", [attn.q_proj, attn.k_proj, attn.v_proj]))
            sites.append(NormSite(layer, "layernorm_after", [layer.mlp.fc1]))
        classifier = getattr(self.model, "classifier", None)
        if isinstance(classifier, nn.Linear):
            sites.append(NormSite(vit, "layernorm", [classifier]))
        else:
            notes.append("final layernorm kept exact: it feeds no linear layer leanbp can fold into")
        return sites

    def activation_owners(self):
        return [(layer.mlp, "activation_fn") for layer in self._vit().layers]


class BertRecipe(_Encoder):
    def _layers(self):
        return getattr(self.model, self.model.base_model_prefix, self.model).encoder.layer

    def norm_sites(self, notes):
        layers, sites = self._layers(), []
        for i, layer in enumerate(layers):
            # post-LN: each norm's output feeds linears *and* the next residual sum
            sites.append(NormSite(layer.attention.output, "LayerNorm", [layer.intermediate.dense], layer.output))
            if i + 1 < len(layers):
                nxt = layers[i + 1].attention
                sites.append(NormSite(layer.output, "LayerNorm", [nxt.self.query, nxt.self.key, nxt.self.value],
                                      nxt.output))
        notes.append("embedding and last-layer LayerNorms kept exact: dropout follows the first, "
                     "task heads read the second")
        return sites

    def activation_owners(self):
        return [(layer.intermediate, "intermediate_act_fn") for layer in self._layers()]
