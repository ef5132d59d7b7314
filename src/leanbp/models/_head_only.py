"""Any other causal LM: the chunked LM head and loss alone (``leanbp.stream(model, layers=False)``).

Without an adapter the decoder runs as transformers writes it, but the head, the largest single
activation of a long-sequence step ((B, T, vocab) logits and their gradient), is still chunked: it
needs only the backbone (the module that returns ``last_hidden_state``, final norm included) and the
output embedding.
"""

from __future__ import annotations

from torch import nn

from ..engine import LogitTransform
from ._base import FamilyAdapter


def head_only_backbone(model: nn.Module) -> nn.Module | None:
    """The module of ``model`` that returns ``last_hidden_state``: its ``base_model``, else its
    ``model`` (Llama 4's causal LM names its prefix ``language_model`` but keeps its decoder at
    ``.model``, so ``base_model`` is the model itself)."""
    for candidate in (getattr(model, "base_model", None), getattr(model, "model", None)):
        if isinstance(candidate, nn.Module) and candidate is not model:
            return candidate
    return None


# Logit transforms of causal LMs that the config fields ``FamilyAdapter.logit_transform`` reads do
# not describe: the factor their forward multiplies the LM head's output by. (The probe at
# ``stream()`` catches any other.)
_HEAD_SCALES = {
    # FalconH1ForCausalLM: logits = lm_head(h) * model.lm_head_multiplier
    "falcon_h1": lambda model: float(getattr(model.model, "lm_head_multiplier", model.config.lm_head_multiplier)),
    # HyperCLOVAX multiplies by logits_scaling (Granite, which the default reads, divides)
    "hyperclovax": lambda model: float(model.config.logits_scaling or 1.0),
    # Inkling divides the hidden states by logits_mup_width_multiplier before a bias-free LM head
    "inkling": lambda model: 1.0 / float(model.config.logits_mup_width_multiplier or 1.0),
}


class HeadOnlyAdapter(FamilyAdapter):
    def backbone(self):
        return head_only_backbone(self.model)

    def check(self):
        c = self.config
        if c.model_type == "inkling":
            unpadded = getattr(c, "unpadded_vocab_size", None)
            if unpadded is not None and unpadded < self.lm_head().weight.shape[0]:
                raise NotImplementedError(
                    f"Inkling's forward keeps the first unpadded_vocab_size={unpadded} of its "
                    f"{self.lm_head().weight.shape[0]} logits; leanbp's chunked head scores every row of the LM "
                    "head, so it would train on other probabilities. Not supported in head-only mode yet.")
            if getattr(self.lm_head(), "bias", None) is not None:
                raise NotImplementedError("Inkling with an LM head bias: dividing the hidden states is not "
                                          "dividing the logits; not supported in head-only mode")

    def logit_transform(self):
        scale = _HEAD_SCALES.get(self.config.model_type)
        if scale is None:
            return super().logit_transform()
        return LogitTransform(scale=scale(self.model), softcap=getattr(self.config, "final_logit_softcapping", None))

    def layers(self):
        return nn.ModuleList()

    def embed_tokens(self):
        return self.model.get_input_embeddings()

    def final_norm(self):
        return nn.Identity()  # part of the backbone's own forward

    def lm_head(self):
        return self.model.get_output_embeddings()

    def key_value(self, layer, hidden, cos, sin):
        raise NotImplementedError

    def chunk_forward(self, *args, **kwargs):
        raise NotImplementedError

    @classmethod
    def tiny_config(cls, window=None, **sizes):
        raise NotImplementedError("the head-only fallback serves models of unregistered families")

    def activation_owners(self):
        return []
