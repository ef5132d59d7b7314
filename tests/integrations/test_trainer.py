"""transformers' Trainer with a streamed model: training with gradient accumulation equals the
Trainer without leanbp (float64), and evaluation / predict / logits-based metrics work."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

import leanbp
from conftest import tiny_model
from leanbp.testing import full_precision_norms, reference_causal_lm_loss
from leanbp.engine import StreamedLayerFunction

datasets = pytest.importorskip("datasets")


def _dataset(n=8, T=23, vocab=101):
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        ids = torch.randint(1, vocab, (T,), generator=g)
        mask = torch.ones(T, dtype=torch.long)
        mask[T - (i % 4) * 3:] = 0  # right padding of different lengths
        labels = ids.masked_fill(mask == 0, -100)
        labels[: 5 + i % 3] = -100  # a prompt
        rows.append({"input_ids": ids.tolist(), "attention_mask": mask.tolist(), "labels": labels.tolist()})
    return datasets.Dataset.from_list(rows)


class _Grads(transformers.TrainerCallback):
    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


def _float64_loss(outputs, labels, num_items_in_batch=None):
    """transformers' causal-LM loss without its float32 cast (the reference run's loss)."""
    logits = outputs.logits
    targets = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100,
                                             reduction="sum")
    return loss / num_items_in_batch


def _train(tmp_path, streamed: bool):
    model = tiny_model("qwen3")
    if streamed:
        leanbp.stream(model, chunk_size=7, head_chunk_size=5)
    grads = _Grads()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2,
        learning_rate=1e-2, report_to=[], use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True,
        remove_unused_columns=False)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_dataset(), callbacks=[grads],
                                   compute_loss_func=None if streamed else _float64_loss)
    with full_precision_norms(model):
        trainer.train()
    return trainer, grads.steps


def test_trainer_with_gradient_accumulation_matches_plain(tmp_path, monkeypatch):
    _, ref_steps = _train(tmp_path / "ref", streamed=False)
    calls = []
    original = StreamedLayerFunction.apply
    monkeypatch.setattr(StreamedLayerFunction, "apply",
                        lambda *a: calls.append(torch.is_grad_enabled()) or original(*a))
    trainer, steps = _train(tmp_path / "leanbp", streamed=True)
    assert sum(calls) == 2 * 2 * 2  # layers x micro-batches x steps (graph-building calls: not the probe)
    assert len(steps) == len(ref_steps) == 2
    for expected, got in zip(ref_steps, steps):
        assert set(expected) == set(got)
        for name, g in expected.items():
            assert ((got[name] - g).norm() / g.norm()).item() <= 1e-12, name


def test_trainer_predict_and_logits_metrics(tmp_path):
    model = tiny_model("llama")
    data = _dataset(n=4)
    batch = data[:4]
    ids, mask = torch.tensor(batch["input_ids"]), torch.tensor(batch["attention_mask"])
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits.numpy()
    leanbp.stream(model)

    def accuracy(prediction):
        logits, labels = prediction.predictions, prediction.label_ids
        hits = (logits[:, :-1].argmax(-1) == labels[:, 1:])[labels[:, 1:] != -100]
        return {"accuracy": float(hits.mean())}

    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=4, report_to=[],
                                          use_cpu=True, disable_tqdm=True, remove_unused_columns=False)
    trainer = transformers.Trainer(model=model, args=args, eval_dataset=data, compute_metrics=accuracy)
    metrics = trainer.evaluate()
    assert np.isfinite(metrics["eval_loss"]) and 0 <= metrics["eval_accuracy"] <= 1
    predictions = trainer.predict(data).predictions
    np.testing.assert_allclose(predictions, expected, rtol=1e-10, atol=1e-10)
    with torch.no_grad(), full_precision_norms(model):
        leanbp.unstream(model)
        plain = reference_causal_lm_loss(model, torch.tensor(batch["labels"]), input_ids=ids, attention_mask=mask)
    assert abs(metrics["eval_loss"] - plain.item()) <= 1e-6 * abs(plain.item())
