"""The time of a step, from the work the fake step counted (``_work.py``) and the bytes the set-up
moves between GPUs and over PCIe, on a GPU of ``_devices.GPUS`` at an efficiency the user states.

    compute  = (product FLOPs / matmul rate + attention FLOPs / attention rate) / efficiency
               (a GPU's attention rate is its matmul peak; a measured CPU's is its flash kernel's;
               a CPU that timed the step's calls at their own shapes, ``time_calls``, adds up
               those times instead)
    memory   = (bytes of the other ops / HBM bandwidth
                + exp/log/erf elements / transcendental rate   (a measured CPU's; none on a GPU)
                + bytes of fresh large results / fresh-page rate) / efficiency   (likewise)
    exchange = bytes a rank sends in the all-to-alls of sequence parallelism x (P - 1) / P
               / (NVLink per direction x efficiency)
    device   = compute + memory + exchange       (one stream: the ops run one after another, and
                                                   a layer waits for its exchanges)
    comm     = bytes each rank sends in the engine's collectives / (NVLink per direction x eff.)
    offload  = bytes the streamed layers' host store moves / (PCIe per direction x efficiency)
    step     = max(device, comm, offload)         (collectives and copies run on side streams,
                                                   overlapping the layers that compute)
             + optimizer                          (after backward, not overlapped: its state read
                                                   and written once at HBM bandwidth, or with a
                                                   host optimizer the gradients down and the
                                                   weights up over PCIe and the host's own pass
                                                   over its 16 bytes per parameter)

The efficiency is one number for every rate (an assumption; every report states it). Long-
sequence fine-tuning on H100s reaches about half the dense peak: TRL's 1M-token Qwen3-8B recipe
(8 x H100, 380 s per step) is 0.5 of the peak by this model. On the CPU the model is checked
against measured steps with the CPU's measured matmul rate, attention rate and bandwidth at
efficiency 1 (``benchmarks/plan_time_check.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ._devices import GPUS, Gpu
from ._setup import RankBytes, Setup
from ._work import Work, is_attention

__all__ = ["StepTime", "step_time", "HOST_BANDWIDTH"]

# the host's memory bandwidth for a host optimizer's pass over its state: an assumption (a
# two-socket server streams 200-400 GB/s; DeepSpeed's CPU Adam is memory-bound and reaches a
# fraction of that), used at the set-up's efficiency
HOST_BANDWIDTH = 100e9


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step on one rank, by part (see the module docstring); ``tokens_per_s``: all
    ranks together."""

    compute: float
    memory: float
    comm: float
    exchange: float
    offload: float
    optimizer: float
    total: float
    tokens_per_s: float
    flops: float  # per rank
    gpu: str
    efficiency: float


def step_time(work: Work, setup: Setup, rank: RankBytes, dtype: str, optimizer: bool = False,
              offload_bytes: int = 0, tokens: int = 0, device: Gpu | None = None) -> StepTime:
    """The step-time model (module docstring) for one rank of ``setup`` doing ``work``; ``device``
    replaces the set-up's GPU (e.g. ``measure_cpu()``)."""
    gpu = device or GPUS[setup.gpu]
    eff = setup.efficiency if device is None else 1.0
    flops, attention, timed = work.flops, work.attention, 0.0
    if gpu.calls and work.calls:  # (each call timed at its own shapes on the measured CPU)
        for signature, (count, call_flops) in work.calls.items():
            if signature in gpu.calls:
                timed += count * gpu.calls[signature]
                flops -= count * call_flops
                attention -= count * call_flops if is_attention(signature) else 0
    compute = (timed + (flops - attention) / gpu.matmul_rate(dtype) + attention / gpu.attention_rate(dtype)) / eff
    memory = work.bytes / gpu.hbm
    transcendental = gpu.transcendental_rate(dtype)
    if transcendental:  # (a CPU evaluates them slower than it moves their bytes; a GPU does not)
        memory += work.transcendental / transcendental
    if gpu.fresh:
        memory += work.fresh / gpu.fresh
    memory /= eff
    comm = rank.collective / (gpu.nvlink * eff) if setup.world > 1 and gpu.nvlink else 0.0
    # (the share a rank sends itself stays on the GPU)
    exchange = work.exchange * (setup.sp - 1) / setup.sp / (gpu.nvlink * eff) if setup.sp > 1 and gpu.nvlink else 0.0
    offload = offload_bytes / (gpu.pcie * eff) if offload_bytes and gpu.pcie else 0.0
    opt = 0.0
    if optimizer:
        if setup.optimizer == "host":
            opt = rank.pcie / (gpu.pcie * eff) + 2 * rank.host / (HOST_BANDWIDTH * eff)
        else:  # read and write the state and the weights, read the gradients
            opt = (2 * rank.optimizer + 2 * rank.weights + rank.grads) / (gpu.hbm * eff)
    total = max(compute + memory + exchange, comm, offload) + opt
    # ``tokens``: one rank's; the P ranks of a sequence-parallel group share their sequences
    return StepTime(compute, memory, comm, exchange, offload, opt, total,
                    setup.world * tokens / total if total else 0.0, work.flops, gpu.name, eff)
