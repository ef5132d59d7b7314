"""Any other causal LM: the chunked LM head and loss alone (``leanbp.stream(model, layers=False)``).

Without an adapter the decoder runs as transformers writes it, but the head, the largest single
activation of a long-sequence step ((B, T, vocab) logits and their gradient), is still chunked: it
needs only the backbone (the module that returns ``last_hidden_state``, final norm included) and the
output embedding.
"""

from __future__ import annotations

from torch import nn

from ._base import FamilyAdapter


class HeadOnlyAdapter(FamilyAdapter):
    def backbone(self):
        return self.model.base_model

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
