"""What one rank holds besides the step's activations: the engine's sharding and buffers, the
optimizer's state, and what the host holds for it.

The fake step (``_planner.py``) runs the model as one process runs it: every weight, every gradient
(resident, as in a training loop's steady state) and the activations, phase by phase. A rank of a
data-parallel engine runs the same step on its own batch (the activations are the same) but keeps a
different set of weights, gradients and buffers. Each engine's share is written here from what the
engine's code allocates (PyTorch 2.13, DeepSpeed 0.19.8), with the place it comes from:

* ``ddp``: every rank holds the whole model, its gradients and the whole optimizer state, and the
  reducer's flat gradient buckets beside the gradients: with ``gradient_as_bucket_view=False`` (the
  default, and what ``leanbp train`` uses) the buckets are a second copy of every gradient
  (``Reducer::initialize_buckets`` allocates ``bucket.gradients`` for all parameters; DDP's
  docstring: with ``gradient_as_bucket_view=True`` "the saved memory size will be equal to the
  total gradients size").
* ``fsdp2`` (``fully_shard`` on every decoder layer and on the root, as ``leanbp train``): each
  parameter is split along dim 0 into ``world`` chunks, every rank's chunk padded to the first's
  ``ceil(d0 / world)`` rows (``FSDPParam._init_sharded_param``: ``padded_sharded_size =
  chunks[0].size()``); gradients and optimizer state follow the local chunk. While a layer runs,
  its parameters are unsharded (``world x`` the padded chunk, ``init_all_gather_outputs``); in
  forward the previous layer's all-gather output is kept until the next copy-out ("defer free to
  allow for overlap", ``FSDPParamGroup.wait_for_unshard``), in backward the next layer is
  prefetched (``_backward_prefetch``) and one reduce-scatter input is held until the next layer's
  post-backward (``reduce_scatter_states``, ``max_input_buffers = 1``). The root's parameters
  (embedding, final norm, LM head) stay unsharded from the root's forward to its post-backward
  ("for the root, do not reshard after forward", ``FSDPState._lazy_init``).
* ``zero2`` (DeepSpeed ``DeepSpeedZeroOptimizer``, config defaults of ``runtime/zero/config.py``):
  the 16-bit weights whole, in one flat buffer padded to a multiple of ``2 x world`` elements
  (``nccl_start_alignment_factor``); an fp32 copy of the rank's partition of the weights
  (``single_partition_of_fp32_groups``) that the optimizer steps; during backward the gradients
  live in an IPG bucket of ``reduce_bucket_size`` = 5e8 elements (``setup_buckets``; two with
  ``overlap_comm``, off by default for stage 2) and the rank's partition of them
  (``grads_in_partition``); the optimizer step converts that partition to fp32.
* ``zero3`` (``DeepSpeedZeroOptimizer_Stage3``): weights, fp32 copy, gradients and optimizer
  state all partitioned (``ceil(numel / world)`` per parameter); a persistent IPG bucket of
  ``reduce_bucket_size`` elements and a persistent flat buffer of the rank's gradient partition
  (``grad_partitions_flat_buffer``); parameters gathered for compute up to
  ``stage3_max_live_parameters`` = 1e9 elements at a time (DeepSpeed's bound on gathered
  parameters, which its prefetching and ``stage3_max_reuse_distance`` fill), and parameters under
  ``stage3_param_persistence_threshold`` = 1e5 elements (norms) kept whole on every rank.

Optimizers (bytes per trainable parameter on its rank's share; one 4-byte ``step`` tensor per
parameter tensor where ``torch.optim.AdamW`` keeps one):

* ``adamw``: two fp32 moments, and an fp32 master copy of 16-bit weights (as DeepSpeed's ZeRO and
  bf16 optimizers, Megatron's distributed optimizer and FSDP2 with fp32 sharded parameters and a
  bf16 ``MixedPrecisionPolicy`` keep one; fp32 weights are their own master, which is
  ``torch.optim.AdamW`` on fp32 parameters to the byte): 8 or 12 bytes.
* ``adamw-bf16``: two bf16 moments, no master (``torch.optim.AdamW`` on bf16 parameters: its
  state takes the parameter's dtype; what the StreamBP paper's ``Trainer`` runs): 4 bytes.
* ``adamw-8bit``: bitsandbytes' ``AdamW8bit`` (``Optimizer2State.init_state``): two uint8 moments
  and one fp32 absmax per block of 256 for each, for tensors of at least ``min_8bit_size`` = 4096
  elements; two fp32 moments below that; no master: 2 + 8/256 bytes.
* ``host``: the moments and an fp32 master copy in host memory, and the fp32 gradients the host
  steps them with (DeepSpeed ZeRO-Offload: ``offload_optimizer: cpu``, ``DeepSpeedCPUAdam``):
  0 device bytes, 16 host bytes; each step moves the rank's gradients to the host and its updated
  weights back over PCIe.

The ZeRO engines always step an fp32 partition (``adamw-bf16`` has no meaning there and is refused).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from .._options import setting
from ..memory import GiB, parse_bytes
from ._devices import GPUS

ENGINES = ("single", "ddp", "fsdp2", "zero2", "zero3")
OPTIMIZERS = ("adamw", "adamw-bf16", "adamw-8bit", "host")

# DeepSpeed 0.19.8 ZeRO defaults (deepspeed/runtime/zero/config.py), in elements
ZERO_REDUCE_BUCKET = 500_000_000
ZERO3_MAX_LIVE = 1_000_000_000
ZERO3_PERSISTENCE = 100_000
# bitsandbytes AdamW8bit (bitsandbytes/optim/optimizer.py): blockwise absmax per 256 elements,
# 8-bit state only for tensors of at least 4096 elements; two 256-entry fp32 quantile maps shared
# by all tensors
BNB_BLOCK = 256
BNB_MIN_8BIT = 4096
BNB_QMAPS = 2 * 256 * 4
STEP_BYTES = 4  # torch.optim.AdamW's per-tensor ``step``: a 0-dim fp32 tensor

FORWARD, BACKWARD = "forward", "backward"
# the engine's phase labels (``leanbp.memory.phase``) that run the backward of a layer
_BACKWARD_PHASES = ("backward", "layer backward")


def machine_memory() -> int:
    """This machine's RAM, bytes (the default host budget)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class Setup:
    """The machine a plan is made for: how many GPUs of which kind, the engine that spreads the
    model over them, the optimizer, the host memory, and the efficiency the step-time model
    assumes. Validated here, for Python and the command line alike."""

    gpus: int = setting(1, help="GPUs training together (one rank each, one machine)")
    engine: str | None = setting(None, choices=ENGINES,
                                 help="how the ranks share the model: single (one GPU), ddp, fsdp2 (fully_shard per "
                                      "decoder layer and the root), zero2, zero3 (DeepSpeed); default single for one "
                                      "GPU, ddp for more")
    optimizer: str = setting("adamw", choices=OPTIMIZERS,
                             help="adamw: fp32 moments (+ an fp32 master copy of 16-bit weights); adamw-bf16: bf16 "
                                  "moments, no master (torch AdamW on bf16 weights); adamw-8bit: bitsandbytes' "
                                  "AdamW8bit; host: moments, master and fp32 gradients in host memory (ZeRO-Offload)")
    host_memory: int | None = setting(None, parse=parse_bytes, metavar="BYTES",
                                      help="host memory offload and a host optimizer may use, all ranks together "
                                           "(default: this machine's RAM)")
    sp: int = setting(1, metavar="P",
                      help="sequence parallelism: each sequence spread over P GPUs (Ulysses inside leanbp's streamed "
                           "layers, leanbp.stream(sequence_parallel=...)); --gpus must be a multiple of P, and the "
                           "plan is leanbp's (the other methods do not split a sequence)")
    offload_params: bool = setting(False, help="zero3 only: the 16-bit weights in host memory, gathered to the GPU "
                                               "layer by layer (DeepSpeed offload_param, as ALST's one-GPU recipes; "
                                               "needs --optimizer host)")
    gpu: str = setting("h100", choices=tuple(GPUS),
                       help="the GPU of the step-time model (vendor data sheet numbers); its memory is --memory's "
                            "default")
    efficiency: float = setting(0.5, help="fraction of the GPU's peak FLOP rate and bandwidths a step reaches "
                                          "(the step-time model's one assumption)")

    def __post_init__(self):
        if not isinstance(self.gpus, int) or isinstance(self.gpus, bool) or self.gpus < 1:
            raise ValueError(f"gpus must be a positive integer, got {self.gpus!r}")
        if self.engine is None:
            object.__setattr__(self, "engine", "single" if self.gpus == 1 else "ddp")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.engine == "single" and self.gpus != 1:
            raise ValueError(f"engine single runs one GPU; for {self.gpus} choose ddp, fsdp2, zero2 or zero3")
        if not isinstance(self.sp, int) or isinstance(self.sp, bool) or self.sp < 1 or self.gpus % self.sp:
            raise ValueError(f"sp must be a positive integer that divides gpus ({self.gpus}), got {self.sp!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.engine.startswith("zero") and self.optimizer == "adamw-bf16":
            raise ValueError("DeepSpeed's ZeRO optimizers step an fp32 copy of the weights: adamw-bf16 (no master, "
                             "bf16 moments) is not one of their set-ups; choose adamw, adamw-8bit or host")
        if self.offload_params and (self.engine != "zero3" or self.optimizer != "host"):
            raise ValueError("offload_params is DeepSpeed ZeRO-3's offload_param: it needs engine zero3 and optimizer "
                             "host (offload_optimizer), as DeepSpeed's ZeRO-Infinity set-ups pair them")
        if self.host_memory is None:
            object.__setattr__(self, "host_memory", machine_memory())
        if not isinstance(self.host_memory, int) or self.host_memory < 0:
            raise ValueError(f"host_memory must be a number of bytes, got {self.host_memory!r}")
        if self.gpu not in GPUS:
            raise ValueError(f"gpu must be one of {tuple(GPUS)}, got {self.gpu!r}")
        if not (isinstance(self.efficiency, (int, float)) and 0 < self.efficiency <= 1):
            raise ValueError(f"efficiency must be in (0, 1], got {self.efficiency!r}")

    @property
    def world(self) -> int:
        return self.gpus

    @property
    def device_state_made_at_first_step(self) -> bool:
        """Whether a step's optimizer makes its state on the device at its first step, into whatever
        that step's allocations left cached: a torch optimizer (AdamW, bitsandbytes' AdamW8bit) on
        one GPU, under DDP or FSDP2. ZeRO makes its flat partitions when the engine starts; the host
        optimizer keeps its state on the host."""
        return self.optimizer != "host" and self.engine not in ("zero2", "zero3")

    def describe(self) -> str:
        gpu = GPUS[self.gpu]
        params = " with the weights offloaded to the host" if self.offload_params else ""
        sp = f", each sequence over {self.sp} of them (sequence parallelism)" if self.sp > 1 else ""
        return (f"{self.gpus} x {gpu.label}{sp}, engine {self.engine}{params}, optimizer {self.optimizer}, host memory "
                f"{self.host_memory / GiB:.1f} GiB for all ranks, efficiency {self.efficiency:g} of the peak rates")


@dataclass(frozen=True)
class Tensor:
    """A parameter as the rank accounting needs it: its shape, dtype, whether it is trained, and
    which FSDP2 unit it belongs to (-1: the root; i: decoder layer i)."""

    shape: tuple
    dtype: torch.dtype
    trainable: bool
    unit: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def parameter_tensors(model) -> list[Tensor]:
    """The parameters of a (fake or meta) causal LM, each with its FSDP2 unit."""
    from ..models import adapter_for
    from ..streaming import causal_lm_of

    layers = list(adapter_for(causal_lm_of(model)).layers())
    unit_of = {}
    for i, layer in enumerate(layers):
        for p in layer.parameters():
            unit_of[id(p)] = i
    return [Tensor(tuple(p.shape), p.dtype, p.requires_grad, unit_of.get(id(p), -1)) for p in model.parameters()]


@dataclass(frozen=True)
class RankBytes:
    """One rank's bytes besides activations, for a model at one depth (every field is a sum over
    tensors or a per-layer constant, so a pair of depths extends them to any depth, as the step).

    ``weights``/``grads``: resident on the device (the rank's share); ``optimizer``: its device
    state; ``buffers``: the engine's resident buffers (DDP's buckets; ZeRO's IPG bucket, gathered
    and persistent parameters); ``forward``/``backward``: the engine's working set while a layer
    runs forward or backward (unsharded layers, prefetched all-gathers, reduce-scatter inputs);
    ``step``: extra bytes of the optimizer step (ZeRO's fp32 gradient partition); ``host``: host
    bytes of the optimizer (per rank). ``full_weights``/``full_grads``: what the one-process fake step
    holds (replaced by the rank's share)."""

    weights: int
    grads: int
    optimizer: int
    buffers: int
    forward: int
    backward: int
    step: int
    host: int
    full_weights: int
    full_grads: int
    pcie: int  # bytes per step over PCIe for the optimizer (host: gradients down, weights up)
    collective: int  # bytes each rank sends per step (ring collectives)

    @staticmethod
    def extend(a: "RankBytes", b: "RankBytes", k: float) -> "RankBytes":
        """``a + k (b - a)``, field by field (the depth line)."""
        return RankBytes(**{f: round(getattr(a, f) + k * (getattr(b, f) - getattr(a, f)))
                            for f in RankBytes.__dataclass_fields__})

    def phase_extra(self, phase: str) -> int:
        """What the rank holds in ``phase`` beyond the one-process step (may be negative)."""
        working = self.backward if phase in _BACKWARD_PHASES else \
            self.forward if phase in ("forward", "layer forward") else max(self.forward, self.backward)
        return (self.weights - self.full_weights) + (self.grads - self.full_grads) + self.buffers + working


def _chunk_rows(d0: int, world: int) -> int:
    return -(-d0 // world)


def _shard_numel(t: Tensor, world: int) -> int:
    """FSDP2's padded local chunk of ``t`` (rank 0 holds the most rows)."""
    if not t.shape:
        return 1
    return _chunk_rows(t.shape[0], world) * math.prod(t.shape[1:])


def _state_bytes(numels: list[int], itemsize: int, optimizer: str, engine: str, world_numel: int = 0) -> int:
    """Device bytes of ``optimizer``'s state for tensors of ``numels`` elements whose weights are
    ``itemsize`` bytes each (see the module docstring)."""
    if optimizer == "host":
        return 0
    if optimizer == "adamw":
        master = 4 if itemsize < 4 or engine.startswith("zero") else 0
        return sum(n * (8 + master) + STEP_BYTES for n in numels)
    if optimizer == "adamw-bf16":
        return sum(n * 4 + STEP_BYTES for n in numels)
    # adamw-8bit (bitsandbytes keeps its step count in Python); ZeRO steps an fp32 partition copy
    master = 4 if engine.startswith("zero") else 0
    total = 0
    for n in numels:
        total += n * master + (2 * n + 2 * 4 * -(-n // BNB_BLOCK) if n >= BNB_MIN_8BIT else 8 * n)
    return total + (BNB_QMAPS if any(n >= BNB_MIN_8BIT for n in numels) else 0)


def rank_bytes(tensors: list[Tensor], setup: Setup) -> RankBytes:
    """One rank's share of ``tensors`` (all of a model at one depth) under ``setup`` (see the
    module docstring for where each number comes from)."""
    N, engine, opt = setup.world, setup.engine, setup.optimizer
    trained = [t for t in tensors if t.trainable]
    full_w = sum(t.numel * t.itemsize for t in tensors)
    full_g = sum(t.numel * t.itemsize for t in trained)
    P = sum(t.numel for t in trained)
    itemsize = max((t.itemsize for t in trained), default=2)  # (ZeRO: one flat group of the weights' dtype)
    host_per_param = 16 if opt == "host" else 0  # fp32 master + its fp32 gradient + two fp32 moments
    ring = (N - 1) / N

    if engine in ("single", "ddp"):
        optimizer = _state_bytes([t.numel for t in trained], itemsize, opt, engine)
        buckets = full_g if engine == "ddp" else 0
        host = host_per_param * P
        pcie = P * 2 * itemsize if opt == "host" else 0
        return RankBytes(full_w, full_g, optimizer, buckets, 0, 0, 0, host, full_w, full_g, pcie,
                         round(2 * ring * full_g))

    if engine == "fsdp2":
        shard_w = sum(_shard_numel(t, N) * t.itemsize for t in tensors)
        shard_g = sum(_shard_numel(t, N) * t.itemsize for t in trained)
        optimizer = sum(_state_bytes([_shard_numel(t, N)], t.itemsize, opt, engine) for t in trained)
        if opt == "adamw-8bit" and any(_shard_numel(t, N) >= BNB_MIN_8BIT for t in trained):
            optimizer -= BNB_QMAPS * (sum(_shard_numel(t, N) >= BNB_MIN_8BIT for t in trained) - 1)
        unsharded = lambda ts: sum(N * _shard_numel(t, N) * t.itemsize for t in ts)  # noqa: E731
        root = [t for t in tensors if t.unit < 0]
        units = sorted({t.unit for t in tensors if t.unit >= 0})
        layer_w = max((unsharded([t for t in tensors if t.unit == u]) for u in units), default=0)
        layer_g = max((unsharded([t for t in trained if t.unit == u]) for u in units), default=0)
        # forward: this layer unsharded + the previous layer's all-gather output (held for overlap);
        # backward: this layer unsharded + the next one prefetched + one reduce-scatter input held,
        # and the root's unsharded gradients (made by the head's backward, reduced at the root's
        # post-backward, after the last layer)
        root_g = unsharded([t for t in root if t.trainable])
        forward, backward = 2 * layer_w, 2 * layer_w + layer_g + root_g
        shard_p = sum(_shard_numel(t, N) for t in trained)
        host = host_per_param * shard_p
        pcie = shard_p * 2 * itemsize if opt == "host" else 0
        root_w = unsharded(root)
        layers_w = shard_w * N - root_w
        collective = round(ring * (2 * layers_w + root_w + shard_g * N))
        return RankBytes(shard_w + root_w, shard_g, optimizer, 0, forward, backward, 0, host, full_w, full_g, pcie,
                         collective)

    # ZeRO: the flat partition of the trainable weights, padded to 2 x world elements
    align = 2 * N
    flat = -(-P // align) * align
    part = flat // N
    optimizer = _state_bytes([part], itemsize, opt, engine)
    host = host_per_param * part
    pcie = part * 2 * itemsize if opt == "host" else 0
    step = part * 4 if opt != "host" and itemsize < 4 else 0  # the fp32 copy of the gradient partition
    frozen_w = full_w - P * itemsize
    # with the optimizer on the host, the reduced gradients are copied into its fp32 partition on the
    # host (ZeRO-2 ``async_inplace_copy_grad_to_fp32_buffer_from_gpu``; ZeRO-3 allocates
    # ``grad_partitions_flat_buffer`` on the optimizer's device): the GPU keeps only the bucket
    grad_part = 0 if opt == "host" else part * itemsize
    if engine == "zero2":
        buckets = ZERO_REDUCE_BUCKET * itemsize  # (overlap_comm off for stage 2: one bucket)
        return RankBytes(flat * itemsize + frozen_w, grad_part, optimizer, buckets, 0, 0, step, host, full_w,
                         full_g, pcie, round(ring * (flat * itemsize) * 2))
    # zero3: every parameter partitioned (per parameter, ceil(numel / world)), small ones kept whole
    per_param = sum(-(-t.numel // N) * t.itemsize for t in tensors)
    persistent = sum(t.numel * t.itemsize for t in tensors if t.numel <= ZERO3_PERSISTENCE)
    gathered = min(ZERO3_MAX_LIVE, sum(t.numel for t in tensors)) * itemsize
    grads = 0 if opt == "host" else sum(-(-t.numel // N) * t.itemsize for t in trained)
    buckets = ZERO_REDUCE_BUCKET * itemsize + persistent + gathered
    if setup.offload_params:  # the partition of the 16-bit weights lives on the host; gathered per use
        host += per_param
        pcie += 2 * per_param  # gathered for forward and again for backward
        per_param = 0
    return RankBytes(per_param, grads, optimizer, buckets, 0, 0, step, host, full_w, full_g, pcie,
                     round(ring * (2 * full_w + full_g)))


__all__ = ["ENGINES", "OPTIMIZERS", "RankBytes", "Setup", "Tensor", "machine_memory", "parameter_tensors",
           "rank_bytes"]
