"""Streamed training under DDP, FSDP2 (fp64 and bf16 mixed precision), DeepSpeed ZeRO-2 and ZeRO-3
(directly and through the transformers Trainer), on 2 CPU processes (gloo): the same gradients and parameters as one process on the whole batch, and
the same collectives as the engine without leanbp, with 5 chunks per layer.

One ``torchrun`` launch runs every engine (``leanbp.testing.conformance``), so the process
start-up is paid once; each test reads its engine's part of the result."""

from __future__ import annotations

import pytest
import torch

import leanbp
from leanbp.testing import reference_causal_lm_loss
from _helpers import forced_probes
from leanbp.testing import conformance as C

HAS_DEEPSPEED = __import__("importlib").util.find_spec("deepspeed") is not None
ENGINES = C.ENGINES if HAS_DEEPSPEED else tuple(e for e in C.ENGINES if not e.startswith("zero"))
LAUNCHED = ENGINES + (C.HF_ENGINES if HAS_DEEPSPEED else ())
DEEPSPEED_ENGINES = tuple(e for e in LAUNCHED if e.startswith(("zero", "trainer_zero")))


def _launch(out, engines, deepspeed_fp16: bool) -> dict:
    return C.run_conformance(out, engines, env=forced_probes(deepspeed_fp16))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every engine, DeepSpeed's fp16 probe answered "no" (as on CPUs whose oneDNN has no fp16)."""
    return _launch(tmp_path_factory.mktemp("dist") / "result.json", LAUNCHED, deepspeed_fp16=False)


@pytest.fixture(scope="module", params=[False, True], ids=["fp16-probe-no", "fp16-probe-yes"])
def deepspeed_results(request, results, tmp_path_factory):
    """The DeepSpeed engines with the fp16 probe answered both ways: "yes" is what every GPU and
    Intel CPUs with AVX512-FP16 answer, where DeepSpeed's ZeRO-3 conversion keeps the model's dtype
    and so refused float64 before leanbp partitioned the model itself."""
    if not HAS_DEEPSPEED:
        pytest.skip("needs deepspeed")
    runs = results if not request.param else \
        _launch(tmp_path_factory.mktemp("dist_fp16") / "result.json", DEEPSPEED_ENGINES, deepspeed_fp16=True)
    assert runs["_probes"] == {"deepspeed_fp16": request.param}  # the workers answered as forced
    return runs


def _reference(dtype, approximated=False):
    """One process, the whole batch: gradients of step 1 and parameters after C.STEPS SGD steps.
    Plain autograd (float64 norms and loss); for an approximated model (whose gradients are not
    plain autograd's by design), the same approximated model streamed in one process."""
    model = C.build_model(dtype, approximated)
    ids, mask, labels = C.full_batch()
    if approximated:
        leanbp.stream(model, chunk_size=C.CHUNK, head_chunk_size=5)
    optimizer = torch.optim.SGD(model.parameters(), lr=C.LR)
    for i in range(C.STEPS):
        if approximated:
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        else:
            reference_causal_lm_loss(model, labels, input_ids=ids, attention_mask=mask).backward()
        if i == 0:
            grads = {n: p.grad.double().clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    return grads, {n: p.detach().double() for n, p in model.named_parameters()}


REFERENCES = {}


def _errors(run: dict, dtype, approximated=False) -> tuple[float, float]:
    """Worst relative error over all parameters: (step-1 gradients, parameters after C.STEPS)."""
    if (dtype, approximated) not in REFERENCES:
        REFERENCES[dtype, approximated] = _reference(dtype, approximated)
    ref_grads, ref_params = REFERENCES[dtype, approximated]

    def worst(got: dict, ref: dict) -> float:
        assert set(got) == set(ref)
        return max(((torch.tensor(got[n], dtype=torch.float64) - r).norm() / r.norm()).item() for n, r in ref.items())

    return worst(run["grads"], ref_grads), worst(run["params"], ref_params)


def _runs(results, engine):
    """(leanbp run, plain run) of ``engine``; a "_late" engine (streamed after wrapping) is compared
    with the plain run of its engine."""
    leanbp_run = results[engine]["leanbp"]
    plain_run = results[engine.removesuffix("_late")]["plain"]
    for kind, run in (("leanbp", leanbp_run), ("plain", plain_run)):
        assert "error" not in run, f"{engine} {kind}:\n{run.get('error')}"
    return leanbp_run, plain_run


def _same_collectives(results, engine):
    leanbp_run, plain_run = _runs(results, engine)
    assert leanbp_run["chunks_per_layer"] == 5 and plain_run["chunks_per_layer"] == 0  # it streamed, 5 chunks
    assert plain_run["collectives"]["calls"], "no collective was counted: the counter sees nothing"
    assert leanbp_run["collectives"] == plain_run["collectives"]


@pytest.mark.parametrize("engine", [e for e in ENGINES if not e.startswith("zero")])
def test_same_collectives_as_the_engine_without_leanbp(results, engine):
    _same_collectives(results, engine)


@pytest.mark.parametrize("engine", ["zero2", "zero3"])
def test_same_collectives_as_deepspeed_without_leanbp(deepspeed_results, engine):
    _same_collectives(deepspeed_results, engine)


@pytest.mark.parametrize("engine", ["ddp", "ddp_late", "fsdp2", "fsdp2_late", "fsdp2_approx"])
def test_float64_training_equals_one_process(results, engine):
    """(fsdp2_approx: leanbp.approx + stream under FSDP2 vs the same approximated model in one process)"""
    leanbp_run, _ = _runs(results, engine)
    grad_err, param_err = _errors(leanbp_run, torch.float64, approximated=engine.endswith("_approx"))
    assert grad_err <= 1e-12 and param_err <= 1e-12, (grad_err, param_err)


def test_bf16_mixed_precision_fsdp2_is_as_accurate_as_without_leanbp(results):
    """fp32 weights, bf16 compute: leanbp's error against fp32 single-process training stays within
    1.5x of plain FSDP2's own (measured: 1.29e-2 vs 1.33e-2 gradients, 4.3e-4 vs 3.6e-4 weights)."""
    leanbp_run, plain_run = _runs(results, "fsdp2_bf16")
    (lg, lp), (pg, pp) = _errors(leanbp_run, torch.float32), _errors(plain_run, torch.float32)
    assert lg <= 1.5 * pg and lp <= 1.5 * pp, (lg, pg, lp, pp)


@pytest.mark.parametrize("engine", ["zero2", "zero3"])
def test_deepspeed_training_equals_one_process_to_its_fp32_gradients(deepspeed_results, engine):
    """DeepSpeed keeps and communicates gradient partitions in fp32 at best (its
    communication_data_type has no fp64), so a float64 model trains to fp32 rounding there, with or
    without leanbp; leanbp stays at that level: within 2x of plain ZeRO's error (or 1e-7)
    (measured: 4.6e-8 vs 6.9e-8)."""
    leanbp_run, plain_run = _runs(deepspeed_results, engine)
    assert leanbp_run["grad_dtype"] == "torch.float32"
    (lg, lp), (pg, pp) = _errors(leanbp_run, torch.float64), _errors(plain_run, torch.float64)
    assert lg <= max(2 * pg, 1e-7) and lp <= max(2 * pp, 1e-7), (lg, pg, lp, pp)


def test_streaming_after_zero3_registered_its_hooks_is_a_clear_error(deepspeed_results):
    error = deepspeed_results["zero3_late"]["leanbp"]["error"]
    assert "RuntimeError" in error and "before deepspeed.initialize" in error, error[-2000:]


def test_the_transformers_trainer_with_a_zero3_config_streams_and_trains_as_without_leanbp(deepspeed_results):
    """The model built under the Trainer's zero.Init (partitioned from the start), streamed, then
    given to the Trainer: it streams (both layers ran streamed), the weights after 3 steps match the
    plain Trainer's to fp32 rounding (measured 3.7e-8), and the collectives are the same (calls, and
    bytes of the tensor collectives; broadcast / all_gather carry pickled Python objects)."""
    runs = deepspeed_results["trainer_zero3"]
    for kind in ("leanbp", "plain"):
        assert "error" not in runs[kind], runs[kind].get("error")
    leanbp_run, plain_run = runs["leanbp"], runs["plain"]
    assert leanbp_run["streamed_layers"] == 2 and plain_run["streamed_layers"] == 0
    worst = max(((torch.tensor(leanbp_run["params"][n]) - torch.tensor(p)).norm() / torch.tensor(p).norm()).item()
                for n, p in plain_run["params"].items())
    assert worst <= 1e-6, worst
    assert leanbp_run["collectives"]["calls"] == plain_run["collectives"]["calls"]
    for kind in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"):
        assert leanbp_run["collectives"]["bytes"][kind] == plain_run["collectives"]["bytes"][kind]
