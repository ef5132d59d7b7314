"""The training engines of ``leanbp train``: one process, DDP, FSDP2, DeepSpeed ZeRO-2 and ZeRO-3.

Each engine says how to wrap the (streamed) model, step the optimizer, clip gradients, and save,
load and export a checkpoint in its own format; the training loop (``_loop.py``) names none.

    single   model.save_pretrained + optimizer.pt (the format a one-process run always had)
    ddp      the same, written by rank 0 (every rank holds the whole model and optimizer)
    fsdp2    torch.distributed.checkpoint of the sharded model and optimizer state (``dcp/``),
             every rank writing its shards
    zero2/3  DeepSpeed's own checkpoint (``deepspeed/``), every rank writing its partitions
    pipeline one stage's parameters and optimizer per rank (``pipeline/stage-S.pt``), every stage
             on the same micro-batches (``leanbp.pipeline``)
    (dpzero) one process, no optimizer state: model.save_pretrained only (``--optimizer dpzero``,
             whose step is ``_zo.py``'s; its state is the step count, in trainer_state.json)

At the end of a run the engine exports an ordinary transformers checkpoint (``OUT/final``) that
loads with ``from_pretrained`` whatever engine trained it.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import partition_for_zero3
from ..models import adapter_for
from ..streaming import causal_lm_of
from ._ranks import launched_by_torchrun, several_processes
from ._safe_load import load_dcp, load_deepspeed_safely, load_tensors

ENGINES = ("single", "ddp", "fsdp2", "zero2", "zero3", "pipeline")
BETAS = (0.9, 0.95)


class Engine:
    """One process: the model as it is, AdamW on its trainable parameters."""

    name = "single"
    # checkpoints hold the weights as a transformers checkpoint, loaded (from_pretrained) before
    # approx/stream/wrapping; ``load`` then restores only the optimizer
    transformers_weights = True
    # ranks that train on the same micro-batches (a pipeline's stages)
    batch_sharers = 1

    def __init__(self, device: torch.device):
        self.device = device
        self.rank, self.world = 0, 1
        self.model: nn.Module | None = None  # the transformers model
        self.module: nn.Module | None = None  # what the loop calls (a wrapper, or the model)
        self.optimizer = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def averaged_ranks(self) -> int:
        """The ranks whose gradients the engine averages (each divides its loss by the step's label
        count over this)."""
        return self.world

    # -- set-up ------------------------------------------------------------------------------
    def prepare(self, model: nn.Module, lr: float, weight_decay: float) -> None:
        self.model = self.module = model
        self.optimizer = torch.optim.AdamW(self._trainable(), lr=lr, weight_decay=weight_decay, betas=BETAS)

    def _trainable(self) -> list[torch.Tensor]:
        return [p for p in self.model.parameters() if p.requires_grad]

    # -- a step ------------------------------------------------------------------------------
    def forward_backward(self, batches: list[dict], denominator: torch.Tensor) -> float:
        """Forward and backward of the step's micro-batches (host tensors, moved one at a time),
        each loss divided by ``denominator``; the gradients accumulate. Returns the losses' sum."""
        total = 0.0
        for b in batches:
            loss = self.module(**{k: v.to(self.device) for k, v in b.items()}, num_items_in_batch=denominator).loss
            self.backward(loss)
            total += loss.item()
        return total

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def clip(self) -> float | None:
        """Clip the gradients to norm 1 (global over all ranks); returns the norm before, or None
        when the engine clips inside its optimizer step (DeepSpeed)."""
        norm = torch.nn.utils.clip_grad_norm_(self._trainable(), 1.0)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def skip(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    # -- across ranks ------------------------------------------------------------------------
    def sum(self, value: float) -> float:
        return value

    def barrier(self) -> None:
        pass

    def first_error(self, error: str | None) -> str | None:
        """The first rank's error, on every rank (so that all stop, none waits forever)."""
        return error

    # -- checkpoints -------------------------------------------------------------------------
    def save(self, folder: Path) -> None:
        """Write this engine's checkpoint into ``folder`` (called on every rank)."""
        if self.is_main:
            self.model.save_pretrained(folder)
            torch.save(self.optimizer.state_dict(), folder / "optimizer.pt")

    def load(self, folder: Path) -> None:
        """Restore what ``save`` wrote, after ``prepare`` (the weights were loaded before it)."""
        self.optimizer.load_state_dict(load_tensors(folder / "optimizer.pt", map_location=self.device))

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights on the main rank (None elsewhere), for the export."""
        return self.model.state_dict() if self.is_main else None

    def export(self, folder: Path) -> None:
        """An ordinary transformers checkpoint of the trained weights (called on every rank)."""
        state = self.full_state_dict()
        if self.is_main:
            self.model.save_pretrained(folder, state_dict=state)

    def close(self) -> None:
        """Release what the engine set up, once the run is done (called on every rank)."""


class ZerothOrderEngine(Engine):
    """One process and no optimizer state: DPZero's update needs only the step's seed and scalar,
    and its privacy state lives in the loop's state (trainer_state.json)."""

    def prepare(self, model: nn.Module, lr: float, weight_decay: float) -> None:
        self.model = self.module = model

    def save(self, folder: Path) -> None:
        self.model.save_pretrained(folder)

    def load(self, folder: Path) -> None:
        pass  # (the weights were loaded from the checkpoint before prepare)


class _Distributed(Engine):
    def __init__(self, device: torch.device):
        super().__init__(device)
        self._owns_group = not dist.is_initialized()  # (a group the caller made stays theirs)
        if self._owns_group:
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend, timeout=timedelta(minutes=30))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def close(self) -> None:
        # a process that exits with its gloo group alive can abort in the group's threads
        # ("terminate called without an active exception") after the run has finished
        if self._owns_group and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    def sum(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t)
        return float(t.item())

    def _comm_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def barrier(self) -> None:
        dist.barrier()

    def first_error(self, error: str | None) -> str | None:
        errors = [None] * self.world
        dist.all_gather_object(errors, error)
        return next((e for e in errors if e is not None), None)


class DDPEngine(_Distributed):
    name = "ddp"

    def prepare(self, model, lr, weight_decay):
        super().prepare(model, lr, weight_decay)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        self.module = nn.parallel.DistributedDataParallel(model, device_ids=device_ids)


class FSDP2Engine(_Distributed):
    """``fully_shard`` on every decoder layer and on the root; sharded checkpoints (DCP)."""

    name = "fsdp2"
    transformers_weights = False

    def prepare(self, model, lr, weight_decay):
        from torch.distributed.fsdp import fully_shard

        for layer in adapter_for(causal_lm_of(model)).layers():
            fully_shard(layer)
        fully_shard(model)
        super().prepare(model, lr, weight_decay)  # the optimizer over the sharded parameters

    def save(self, folder: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(folder / "dcp"))
        if self.is_main:
            self.model.config.save_pretrained(folder)

    def load(self, folder: Path) -> None:
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        load_dcp(state, folder / "dcp")
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    def full_state_dict(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=options)  # (empty on other ranks)


class DeepSpeedEngine(_Distributed):
    """DeepSpeed ZeRO-2 or ZeRO-3 with a PyTorch AdamW (no compiled DeepSpeed optimizer needed);
    gradient clipping (to norm 1) and the all-reduce / reduce-scatter are DeepSpeed's."""

    transformers_weights = False

    def __init__(self, device: torch.device, stage: int):
        super().__init__(device)
        self.stage = stage
        self.name = f"zero{stage}"

    def prepare(self, model, lr, weight_decay):
        import deepspeed

        super().prepare(model, lr, weight_decay)  # the same AdamW, handed to DeepSpeed to wrap
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": self.stage}, "zero_allow_untested_optimizer": True,
                  "gradient_clipping": 1.0, "steps_per_print": 10**9}
        if self.stage == 3:  # partition every parameter, however small (DeepSpeed keeps small ones whole)
            config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
            partition_for_zero3(model, config)  # (with a dtype that does not depend on the machine)
        self.module, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=self.optimizer, config=config)

    def backward(self, loss):
        self.module.backward(loss)

    def clip(self) -> None:
        return None  # DeepSpeed owns the gradient partitions and clips by their global norm in step()

    def set_lr(self, lr):
        for group in self.module.optimizer.param_groups:
            group["lr"] = lr

    def step(self):
        self.module.step()

    def skip(self):
        self.module.zero_grad()

    def save(self, folder: Path) -> None:
        self.module.save_checkpoint(str(folder / "deepspeed"), tag="state")
        if self.is_main:
            self.model.config.save_pretrained(folder)

    def load(self, folder: Path) -> None:
        load_deepspeed_safely(self.module)
        path, _ = self.module.load_checkpoint(str(folder / "deepspeed"), tag="state")
        if path is None:
            raise ValueError(f"no DeepSpeed checkpoint in {folder}")

    def full_state_dict(self):
        if self.stage != 3:
            return super().full_state_dict()
        import deepspeed

        state = {}
        for name, p in self.model.named_parameters():  # gathered one at a time, copied on the main rank
            with deepspeed.zero.GatheredParameters([p]):
                if self.is_main:
                    state[name] = p.detach().cpu().clone()
        if self.is_main:
            state.update({n: b.detach().cpu() for n, b in self.model.named_buffers()
                          if n in self.model.state_dict()})
        return state if self.is_main else None


class PipelineEngine(_Distributed):
    """Every rank one stage of a pipeline (``leanbp.pipeline.Pipeline``): its layers, its AdamW, its
    part of each checkpoint. The step's micro-batches form one batch that the schedule walks. With
    more ranks than stages, R = ranks / stages pipelines side by side (consecutive ranks form one),
    each on its own micro-batches, and each stage's gradients averaged over its R replicas (one
    all-reduce per parameter per step, over the group of that stage's ranks)."""

    name = "pipeline"
    transformers_weights = False

    def __init__(self, device: torch.device, schedule: str, microbatches: int, stages: int):
        super().__init__(device)
        if self.world % stages:
            raise ValueError(f"--engine pipeline --stages {stages}: the {self.world} processes are not a whole number "
                             f"of pipelines (launch a multiple of {stages})")
        self.batch_sharers = stages
        self.replicas = self.world // stages
        self.schedule, self.microbatches = schedule, microbatches
        # (every rank makes every group, as new_group requires)
        pipelines = [dist.new_group(list(range(r * stages, (r + 1) * stages))) for r in range(self.replicas)]
        replicas = [dist.new_group(list(range(s, self.world, stages))) for s in range(stages)]
        self.pipeline_group = pipelines[self.rank // stages]
        self.replica_group = replicas[self.rank % stages] if self.replicas > 1 else None
        self.pipe = None

    @property
    def averaged_ranks(self) -> int:
        return self.replicas  # (a stage's gradients are whole within its pipeline)

    def prepare(self, model, lr, weight_decay):
        from ..pipeline import Pipeline

        self.model = model
        self.pipe = Pipeline(model, schedule=self.schedule, microbatches=self.microbatches, device=self.device,
                             group=self.pipeline_group)
        self.module = self.pipe.module
        self.optimizer = torch.optim.AdamW(self._trainable(), lr=lr, weight_decay=weight_decay, betas=BETAS)

    def _trainable(self) -> list[torch.Tensor]:
        return [p for p in self.pipe.parameters() if p.requires_grad]

    def forward_backward(self, batches, denominator):
        whole = {k: torch.cat([b[k] for b in batches]) for k in ("input_ids", "labels", "attention_mask")}
        mask = whole["attention_mask"]
        loss = self.pipe.step(whole["input_ids"], whole["labels"], attention_mask=None if bool(mask.all()) else mask,
                              num_items=denominator)
        if self.replica_group is not None:  # the stage's replicas average their gradients
            for p in self._trainable():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=self.replica_group)
                    p.grad.div_(self.replicas)
        return float(loss)

    def clip(self) -> float:
        """Clip to norm 1 by the norm over every stage's gradients (one all-reduce in the pipeline;
        its replicas hold the same averaged gradients)."""
        grads = [p.grad for p in self._trainable() if p.grad is not None]
        squares = torch.zeros(1, dtype=torch.float64, device=self._comm_device())
        for g in grads:
            squares += g.detach().double().pow(2).sum().to(squares.device)
        dist.all_reduce(squares, group=self.pipeline_group)
        norm = float(squares.sqrt())
        scale = 1.0 / (norm + 1e-6)
        if scale < 1:
            for g in grads:
                g.mul_(scale)
        return norm

    def _stage_state(self) -> dict[str, torch.Tensor]:
        mine = {id(p) for p in self.pipe.parameters()}
        return {n: p.detach() for n, p in self.model.named_parameters() if id(p) in mine}

    def save(self, folder: Path) -> None:
        """The first pipeline's stages write their files (the replicas hold the same state)."""
        if self.rank < self.batch_sharers:
            (folder / "pipeline").mkdir(exist_ok=True)
            torch.save({"model": self._stage_state(), "optimizer": self.optimizer.state_dict()},
                       folder / "pipeline" / f"stage-{self.pipe.stage_index}.pt")
        if self.is_main:
            self.model.config.save_pretrained(folder)

    def load(self, folder: Path) -> None:
        saved = load_tensors(folder / "pipeline" / f"stage-{self.pipe.stage_index}.pt", map_location=self.device)
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, value in saved["model"].items():
                params[name].copy_(value)
        self.optimizer.load_state_dict(saved["optimizer"])

    def full_state_dict(self):
        """Every stage's weights, gathered from the first pipeline on the main rank."""
        parts = [None] * self.world if self.is_main else None
        mine = {n: t.cpu() for n, t in self._stage_state().items()} if self.rank < self.batch_sharers else {}
        dist.gather_object(mine, parts, dst=0)
        if not self.is_main:
            return None
        state = {n: t.cpu() for n, t in self.model.state_dict().items()}
        for part in parts:
            state.update(part)
        return state


def make_engine(name: str, device: torch.device, optimizer: str = "adamw", schedule: str = "1f1b",
                microbatches: int = 1, stages: int = 1) -> Engine:
    if name not in ENGINES:
        raise ValueError(f"--engine must be one of {ENGINES}, got {name!r}")
    if name == "single":
        if several_processes():
            raise ValueError("this process is one of several (WORLD_SIZE > 1): choose --engine ddp, fsdp2, zero2 or zero3")
        return ZerothOrderEngine(device) if optimizer == "dpzero" else Engine(device)
    if not launched_by_torchrun() and not dist.is_initialized():
        raise ValueError(f"--engine {name} runs one process per device: launch with `torchrun --nproc_per_node=N -m "
                         f"leanbp train ...` or pass --nproc N")
    if device.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    if name == "pipeline":
        return PipelineEngine(device, schedule, microbatches, stages)
    if name.startswith("zero"):
        try:
            import deepspeed  # noqa: F401  (before leanbp.stream: the streamed layers become ZeRO-3 leaves)
        except ImportError:
            raise ImportError("--engine zero2/zero3 needs DeepSpeed: pip install -e '.[deepspeed]'") from None
        return DeepSpeedEngine(device, int(name[-1]))
    return {"ddp": DDPEngine, "fsdp2": FSDP2Engine}[name](device)
