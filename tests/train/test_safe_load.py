"""A run folder from elsewhere can carry a pickle that runs code; --resume refuses it and runs nothing.

Each crafted file names ``builtins.exec`` with code that would write a marker file; the test
checks the clear error and that the marker was never written. The allowlists are also checked to
accept what the formats really hold (the 2-process resume tests load real FSDP2 / ZeRO
checkpoints through them)."""

from __future__ import annotations

import importlib.util
import json
import pickle

import pytest
import torch

from leanbp.cli import main
from leanbp.train._safe_load import UnsafeCheckpointError, load_dcp, load_deepspeed_safely, load_tensors

TINY = ["train", "--seq-len", "32", "--chunk-size", "16", "--head-chunk-size", "24", "--save-every", "1"]


class Payload:
    """Unpickled, it calls exec(code): what a hostile checkpoint would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def test_a_crafted_optimizer_state_is_refused_on_resume_and_runs_nothing(tmp_path, capsys):
    out, marker = tmp_path / "run", tmp_path / "payload-ran"
    assert main([*TINY, "--steps", "1", "--out", str(out)]) == 0
    optimizer = out / "checkpoint" / "optimizer.pt"
    state = torch.load(optimizer, weights_only=True)
    state["param_groups"][0]["extra"] = Payload(marker)  # one object hidden among plain data
    torch.save(state, optimizer)
    capsys.readouterr()
    assert main([*TINY, "--steps", "2", "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "optimizer.pt: refused to load" in err and "(it names exec)" in err, err
    assert not marker.exists()
    # the untouched run resumes as ever
    state["param_groups"][0].pop("extra")
    torch.save(state, optimizer)
    assert main([*TINY, "--steps", "2", "--out", str(out), "--resume"]) == 0
    assert json.loads((out / "checkpoint" / "trainer_state.json").read_text())["step"] == 2


def test_load_tensors_accepts_tensors_and_named_classes_only(tmp_path):
    path, marker = tmp_path / "x.pt", tmp_path / "ran"
    torch.save({"w": torch.ones(3), "lr": 1e-3, "betas": (0.9, 0.95)}, path)
    assert load_tensors(path)["betas"] == (0.9, 0.95)
    torch.save({"w": torch.ones(3), "p": Payload(marker)}, path)
    with pytest.raises(UnsafeCheckpointError, match=r"it names (builtins\.)?exec"):
        load_tensors(path)
    assert not marker.exists()


def _dcp_checkpoint(folder, state):
    import torch.distributed.checkpoint as dcp

    with pytest.warns(UserWarning):  # (no process group: DCP saves this process's state alone)
        dcp.save(state, checkpoint_id=str(folder))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_dcp_metadata_and_items_that_name_code_are_refused(tmp_path):
    marker = tmp_path / "ran"
    good = tmp_path / "good"
    _dcp_checkpoint(good, {"w": torch.arange(4.0), "groups": [{"lr": 1e-3, "betas": (0.9, 0.95)}]})
    state = {"w": torch.zeros(4), "groups": [{"lr": 0.0, "betas": (0.0, 0.0)}]}
    load_dcp(state, good)  # what DCP really writes passes
    assert state["w"].tolist() == [0, 1, 2, 3] and state["groups"][0]["betas"] == (0.9, 0.95)

    # a hostile .metadata (DCP unpickles it with no allowlist)
    bad = tmp_path / "bad_metadata"
    _dcp_checkpoint(bad, {"w": torch.arange(4.0)})
    (bad / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: refused to load.*it names builtins\.exec"):
        load_dcp({"w": torch.zeros(4)}, bad)
    # a hostile item (DCP's planner unpickles non-tensor items with weights_only=False)
    item = tmp_path / "bad_item"
    _dcp_checkpoint(item, {"w": torch.arange(4.0), "extra": Payload(marker)})
    with pytest.raises(UnsafeCheckpointError, match="DCP item 'extra'"):
        load_dcp({"w": torch.zeros(4), "extra": None}, item)
    assert not marker.exists()


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_deepspeed_checkpoints_load_through_the_allowlist(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    class Engine:  # (DeepSpeed reads every checkpoint file through engine.checkpoint_engine.load)
        class checkpoint_engine:
            @staticmethod
            def load(path, map_location=None):
                return torch.load(path, map_location=map_location, weights_only=False)

    engine = Engine()
    load_deepspeed_safely(engine)
    path, marker = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt", tmp_path / "ran"
    torch.save({"optimizer_state_dict": {"loss_scaler": LossScaler(1.0), "state": {0: torch.ones(2)}}}, path)
    assert isinstance(engine.checkpoint_engine.load(path)["optimizer_state_dict"]["loss_scaler"], LossScaler)
    torch.save({"optimizer_state_dict": {"loss_scaler": Payload(marker)}}, path)
    with pytest.raises(UnsafeCheckpointError, match=r"it names (builtins\.)?exec"):
        engine.checkpoint_engine.load(path)
    assert not marker.exists()


def test_the_checks_are_explicit_in_the_code():
    """No bare torch.load anywhere in the package: every load states weights_only=True (or goes
    through load_tensors), so every torch the package allows behaves the same."""
    import ast
    from pathlib import Path

    import leanbp

    bare = []
    for path in Path(leanbp.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in ("torch", "pickle")):
                kw = {k.arg: k.value for k in node.keywords}
                safe = isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True
                if not safe:
                    bare.append(f"{path.name}:{node.lineno}")
    assert not bare, bare
