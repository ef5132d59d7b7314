"""The GPUs the step-time model knows, from the vendors' data sheets, and a measured stand-in for
this CPU (which is how the model is checked without a GPU).

Rates are peaks: dense matrix math (no 2:4 sparsity; the data sheets print the sparse figure,
twice the dense one, with a footnote), HBM bandwidth, NVLink per direction (the data sheets give
both directions together: 600 / 900 / 1800 GB/s) and PCIe per direction (x16 links: Gen4 32 GB/s,
Gen5 64 GB/s each way; the data sheets give 64 / 128 GB/s both ways). fp32 matmuls run at the
plain FP32 rate (PyTorch keeps ``allow_tf32`` off for matmuls by default).

* A100 80GB SXM: https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
  (BF16 312 TFLOPS, FP32 19.5, HBM2e 2,039 GB/s, NVLink 600 GB/s, PCIe Gen4 64 GB/s, 80 GB)
* A800 80GB SXM: the A100 with NVLink at 400 GB/s (NVIDIA A800 data sheet,
  https://www.nvidia.cn/data-center/a800/); the StreamBP paper's GPU
* H100 SXM: https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet
  (BF16 1,979 TFLOPS with sparsity = 989 dense, FP32 67, HBM3 3.35 TB/s, NVLink 900 GB/s,
  PCIe Gen5 128 GB/s, 80 GB)
* H200 SXM: https://www.nvidia.com/en-us/data-center/h200/ (the H100's compute, 141 GB HBM3e at
  4.8 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s)
* B200 (HGX B200, 1000 W): https://www.nvidia.com/en-us/data-center/hgx/ (FP16/BF16 4.5 PFLOPS
  with sparsity = 2.25 dense, FP32 80 TFLOPS, 180 GB HBM3e at 8 TB/s per GPU, NVLink 5 1.8 TB/s;
  the host link is taken as PCIe Gen5, that of the x86 hosts HGX B200 boards ship with)

The memory sizes are what ``--memory`` defaults to, the memory the driver reports (nvidia-smi's
total): the "80GB" of the A100/A800 is 80 GiB (81,920 MiB); the H100's 80 GiB of HBM shows as
81,559 MiB, taken as 80 GiB here (0.4% more; the reserve's context absorbs it). The H200's "141GB"
shows as 143,771 MiB (140.4 GiB) and the B200's "180GB" as 183,359 MiB (179.1 GiB): the vendors'
figures are near the GiB the driver shows, not GB. (Until 2026-12-07 these two were taken as 141e9
and 180e9 bytes, 131.3 and 167.6 GiB: ALST's H200 recipe reads 137.36 GiB in use, more than that.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..memory import GiB, MiB
from ._work import Operand, _cpu_flash_backward, _cpu_flash_forward

__all__ = ["Gpu", "GPUS", "measure_cpu", "time_calls"]

TB = 1e12
GB = 1e9


@dataclass(frozen=True)
class Gpu:
    """Peak rates of one device. ``flops``: matmul FLOP/s by the dtype of the operands; ``memory``:
    bytes of device memory; ``hbm``, ``nvlink``, ``pcie``: bytes/s (links: per direction);
    ``attention``: the attention kernels' FLOP/s by dtype where they are known to differ from the
    matmul rate (a measured CPU), else None (the matmul rate: a GPU's flash kernels run on its
    tensor cores, and the data sheets give no other figure). ``transcendental``: elements/s of the
    ops that take an exp, log or erf per element, and ``fresh``: bytes/s at which fresh pages fault
    in (``Work``'s counts of the same names), where they are slower than the traffic the ops make
    (a measured CPU); None on a GPU, whose special-function units outrun its HBM (an H100's 132 SMs
    x 16 per clock x 1.98 GHz = 4.2e12 exps/s against 3.35 TB/s / 4 bytes of a bf16 read and
    write = 0.84e12 elements/s) and whose caching allocator reuses its blocks."""

    name: str
    label: str
    memory: int
    flops: dict = field(hash=False)
    hbm: float
    nvlink: float
    pcie: float
    source: str
    attention: dict | None = field(default=None, hash=False)
    transcendental: dict | None = field(default=None, hash=False)
    fresh: float | None = None
    # {call signature: seconds of one call} where each call of a step was timed here (``time_calls``)
    calls: dict | None = field(default=None, hash=False, compare=False, repr=False)

    def matmul_rate(self, dtype: str) -> float:
        return self.flops["bf16" if dtype == "fp16" else dtype]

    def attention_rate(self, dtype: str) -> float:
        return self.attention["bf16" if dtype == "fp16" else dtype] if self.attention else self.matmul_rate(dtype)

    def transcendental_rate(self, dtype: str) -> float | None:
        return self.transcendental["bf16" if dtype == "fp16" else dtype] if self.transcendental else None


_A100 = dict(flops={"bf16": 312 * TB, "fp32": 19.5 * TB}, hbm=2039 * GB, pcie=32 * GB)
GPUS: dict[str, Gpu] = {g.name: g for g in (
    Gpu("a100", "A100 80GB SXM", 80 * GiB, nvlink=300 * GB, **_A100,
        source="https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
               "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"),
    Gpu("a800", "A800 80GB SXM", 80 * GiB, nvlink=200 * GB, **_A100, source="https://www.nvidia.cn/data-center/a800/"),
    Gpu("h100", "H100 SXM 80GB", 80 * GiB, flops={"bf16": 989 * TB, "fp32": 67 * TB}, hbm=3350 * GB, nvlink=450 * GB,
        pcie=64 * GB, source="https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"),
    Gpu("h200", "H200 SXM 141GB", 143771 * MiB, flops={"bf16": 989 * TB, "fp32": 67 * TB}, hbm=4800 * GB,
        nvlink=450 * GB, pcie=64 * GB, source="https://www.nvidia.com/en-us/data-center/h200/"),
    Gpu("b200", "B200 (HGX) 180GB", 183359 * MiB, flops={"bf16": 2250 * TB, "fp32": 80 * TB}, hbm=8000 * GB,
        nvlink=900 * GB, pcie=64 * GB, source="https://www.nvidia.com/en-us/data-center/hgx/"),
)}


def _best_seconds(fn, seconds: float) -> float:
    """The fastest of repeated runs of ``fn`` for ``seconds``, after one warm-up run."""
    fn()  # (warm-up: threads, packing buffers)
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_cpu(dtype: torch.dtype = torch.float32, size: int = 2048, seconds: float = 2.0,
                heads: tuple[int, int] = (8, 4), head_dim: int = 64) -> Gpu:
    """This CPU as the step-time model sees a device: its measured matmul rate (``size`` cubed
    products in ``dtype``, the best of repeated runs for ``seconds``), attention rate (the CPU flash
    kernel's forward and backward for 1024 queries against 4096 keys with ``heads`` = (query, K/V)
    heads of ``head_dim``, FLOPs as the planner counts them), memory bandwidth (a copy of
    256 MiB, read + write), transcendental rate (log-softmax forward and backward over rows of
    32000, into tensors allocated before) and fresh-page rate (256 MiB allocated and filled, less
    the time of the fill into memory touched before); links are not used on one CPU. The
    attention rate is its own figure because the kernel runs below the rate of a large square
    product (0.7-0.9x on an AMD EPYC with 2 threads: an attention block's products are head_dim
    wide)."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    flops = 2 * size**3 / _best_seconds(lambda: torch.mm(a, b), seconds)
    q = torch.randn(1, heads[0], 1024, head_dim, dtype=dtype)
    k, v = (torch.randn(1, heads[1], 4096, head_dim, dtype=dtype) for _ in range(2))
    aten = torch.ops.aten

    def attention():
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False)[:2]
        aten._scaled_dot_product_flash_attention_for_cpu_backward(torch.ones_like(out), q, k, v, out, lse, 0.0, False)

    attention_flops = (_cpu_flash_forward(q, k, v) + _cpu_flash_backward(None, q, k, v, None, None)) / \
        _best_seconds(attention, seconds)
    x = torch.empty(64 * 2**20, dtype=torch.float32)  # 256 MiB
    y = torch.empty_like(x)
    bandwidth = 2 * x.numel() * 4 / _best_seconds(lambda: y.copy_(x), seconds / 2)
    fill = _best_seconds(lambda: y.fill_(1.0), seconds / 2)
    # (each allocation this large is a fresh mapping: its pages fault in as the fill touches them;
    # a fresh fill no slower than the other, within the timer's noise, leaves a cost of about zero)
    fresh = y.nbytes / max(_best_seconds(lambda: torch.empty_like(y).fill_(1.0), seconds / 2) - fill, 1e-9)
    del x, y
    logits = torch.randn(512, 32000, dtype=dtype)
    logprobs, grad, dlogits = (torch.empty_like(logits) for _ in range(3))
    grad.fill_(1e-5)

    def log_softmax():
        aten._log_softmax.out(logits, -1, False, out=logprobs)
        aten._log_softmax_backward_data.out(grad, logprobs, -1, dtype, out=dlogits)

    transcendental = 2 * logits.numel() / _best_seconds(log_softmax, seconds / 2)
    name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    return Gpu("cpu", f"this CPU ({torch.get_num_threads()} threads, measured)", 0, {name: flops},
               bandwidth, 0.0, 0.0, "measured by leanbp.plan.measure_cpu", attention={name: attention_flops},
               transcendental={name: transcendental}, fresh=fresh)


def _operand(description):
    """A random tensor with a recorded operand's layout (values near the scale of a layer's)."""
    if isinstance(description, Operand):
        shape, stride, dtype = description
        size = 1 + sum((n - 1) * st for n, st in zip(shape, stride)) if all(shape) else 0
        base = torch.randn(size, dtype=dtype) * 0.1 if dtype.is_floating_point else torch.zeros(size, dtype=dtype)
        return base.as_strided(shape, stride)
    if isinstance(description, tuple):
        return tuple(_operand(d) for d in description)
    return description


def time_calls(calls: dict, seconds: float = 0.3) -> dict:
    """Seconds of one call of each distinct product and attention call of a step (``Work.calls``) on
    this CPU: the call remade on random operands of its recorded layouts, the fastest of repeated runs
    for up to ``seconds`` after a warm-up run."""
    timed = {}
    for signature in calls:
        func, args, kwargs = signature
        args, kwargs = _operand(args), {k: _operand(v) for k, v in kwargs}
        timed[signature] = _best_seconds(lambda: func(*args, **kwargs), seconds)
    return timed
