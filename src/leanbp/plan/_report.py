"""``leanbp plan`` output: one rank's peak and the step's time at each T per method, the longest T
that fits the device and the host, as a table, CSV, JSON and a plot (memory and time against T per
method, with the budget line)."""

from __future__ import annotations

import contextlib
import csv
import json
import multiprocessing
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..memory import GiB, MiB
from ..streaming import METHODS, PLANNED, StreamConfig
from ._devices import GPUS
from ._planner import SEQUENCE_METHODS, Planner
from ._setup import Setup

DEFAULT_SEQ_LENS = [4096, 16384, 65536, 131072, 262144, 1048576]


@dataclass(frozen=True)
class CudaReserve:
    """What a CUDA training process holds on the device besides its tensors, which a fake step
    cannot see; ``leanbp plan`` holds it back from the budget unless ``--reserve`` says otherwise.

    * ``context``: the CUDA context with the kernels a training step loads. Measured 0.27 GiB with
      lazy module loading (PyTorch's default since 1.13) and 0.62 GiB without (pytorch/pytorch
      PR 86509); "around 400MB if CUDA >= 11.7" (a maintainer, pytorch/pytorch issue 109888). cuBLAS,
      cuDNN and the attention kernels load into it as they first run: 1 GiB leaves room for them.
    * ``workspaces``: cuBLAS keeps a workspace per (handle, stream), 32 MiB on sm90+ and 8.1 MiB
      before (aten/src/ATen/cuda/CublasHandlePool.cpp); two streams with offload: 64 MiB.
    * ``fragmentation``: the caching allocator's reserved-but-unallocated memory at the peak, as a
      share of the device memory: 5%, an assumption. It depends on how allocation sizes change over
      a run (from tens of MiB to 16 of 93 reserved GiB in meta-pytorch/torchrec PR 4584); a streamed
      step repeats the same chunk sizes, and ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``
      keeps it small. ``benchmarks/cuda_check.py`` measures it when a GPU is lent. Where the plan
      replays a step (``PlanRequest.replayed``) the allocator's model (``_allocator.py``) stands
      for it instead.
    """

    context: int = GiB
    workspaces: int = 64 * MiB
    fragmentation: float = 0.05

    def total(self, memory: int) -> int:
        return self.context + self.workspaces + int(self.fragmentation * memory)

    def describe(self, memory: int) -> str:
        parts = f"CUDA context {self.context / GiB:.2f} + cuBLAS workspaces {self.workspaces / GiB:.2f}"
        if not self.fragmentation:
            return parts
        return (f"{parts} + allocator fragmentation {self.fragmentation:.0%} of the memory "
                f"{self.fragmentation * memory / GiB:.2f} GiB")


# how the plan accounts for the CUDA caching allocator (``PlanRequest.allocator``, ``--allocator``)
ALLOCATORS = ("auto", "share", "replay")


@dataclass
class PlanRequest:
    model: str = "qwen3-8b"
    # the device's memory, bytes (None: the set-up's GPU's, ``GPUS[setup.gpu].memory``)
    memory: int | None = None
    # held back for what the plan does not model; None: ``CudaReserve``'s default for this memory
    reserve: int | None = None
    dtype: str = "bf16"
    batch: int = 1
    seq_lens: list[int] = field(default_factory=lambda: list(DEFAULT_SEQ_LENS))
    methods: list[str] | None = None  # None: all of PLANNED, or leanbp alone with sequence parallelism
    modes: list[str] = field(default_factory=lambda: ["backprop", "step"])
    stream: StreamConfig = field(default_factory=StreamConfig)  # leanbp's settings (a fixed chunk size)
    hold_outputs: bool = True
    free_grads: bool = False  # the loop frees the gradients between steps (``Planner.free_grads``)
    lora_rank: int | None = None
    quantize: str = "none"  # "nf4": the frozen base in bitsandbytes' 4 bits (QLoRA; ``Planner.quantize``)
    setup: Setup = field(default_factory=Setup)  # GPUs, engine, optimizer, host memory, GPU model, efficiency
    # "share": the reserve holds back a share of the memory for the caching allocator's fragmentation;
    # "replay": plain autograd's and checkpointing's steps are played through the allocator's model
    # instead (``Planner.longest_allocated``), the streamed methods keep the share; "auto": replay
    # where the model matched published runs, the share elsewhere (``replayed``)
    allocator: str = "auto"
    reserve_note: str = "given"  # where the reserve comes from (filled in for the default)

    def __post_init__(self):
        if not isinstance(self.setup, Setup):
            raise ValueError(f"setup must be a leanbp.plan.Setup, got {type(self.setup).__name__}")
        if self.methods is None:
            self.methods = ["leanbp"] if self.setup.sp > 1 else list(PLANNED)
        bad = [m for m in self.methods if m not in PLANNED]
        if bad or not self.methods:
            raise ValueError(f"methods: {bad or 'none given'}; choose from {list(PLANNED)}")
        if self.setup.sp > 1 and not set(self.methods) <= set(SEQUENCE_METHODS):
            raise ValueError(f"with sequence parallelism (sp {self.setup.sp}) the plan is leanbp's "
                             f"({', '.join(SEQUENCE_METHODS)}): {self.methods} includes methods that do not split a "
                             "sequence")
        bad = [m for m in self.modes if m not in ("backprop", "step")]
        if bad or not self.modes:
            raise ValueError(f"modes: {bad or 'none given'}; choose from backprop, step")
        if not self.seq_lens or any(not isinstance(t, int) or t < 1 for t in self.seq_lens):
            raise ValueError(f"seq_lens must be positive integers, got {self.seq_lens}")
        if self.allocator not in ALLOCATORS:
            raise ValueError(f"allocator must be one of {ALLOCATORS}, got {self.allocator!r}")
        if self.memory is None:
            self.memory = GPUS[self.setup.gpu].memory
        if self.reserve is None:
            default = CudaReserve()
            if self.allocator != "share":  # (the model stands for the fragmentation share where it replays)
                default = replace(default, fragmentation=0.0)
            self.reserve, parts = default.total(self.memory), default.describe(self.memory)
            self.reserve_note = f"default: {parts}; --reserve to change"
            if self.reserve >= self.memory:
                raise ValueError(f"the default reserve ({parts}) is more than the memory ({self.memory / GiB:.2f} GiB): "
                                 "pass --reserve (e.g. 0 for a toy budget)")
        played = ("; plain autograd and checkpointing are played through the CUDA caching allocator's model (two "
                  "steps) in place of a fragmentation share")
        share = f"{CudaReserve().fragmentation:.0%} of the memory for it"
        if self.allocator == "replay":
            self.reserve_note += f"{played}, the streamed methods keep {share}"
        elif self.allocator == "auto":
            self.reserve_note += (f"{played} where the device holds no optimizer state made at the first step "
                                  f"(backprop, ZeRO, the host optimizer), the other plans keep {share} (--allocator)")
        if self.reserve >= self.memory:
            raise ValueError("the reserve must be smaller than the memory")

    @property
    def budget(self) -> int:
        return self.memory - self.reserve

    def replayed(self, method: str, mode: str) -> bool:
        """Whether ``method``'s longest T in ``mode`` comes from replaying its steps through the caching
        allocator's model (else its tensors fit a budget that holds back a share for the allocator).
        Never for a streamed method: a fake step at full depth is too slow at the lengths it reaches.
        ``auto`` replays where the model was checked against published runs: backprop only, and steps
        whose optimizer state is on the device from the start (ZeRO) or on the host (ALST's recipes,
        within 2%). Where a torch optimizer makes its moments on the device at the first step the
        model puts them into the first step's cached segments and plans 38% short of the StreamBP
        paper's full fine-tuning run, so ``auto`` keeps the share there (docs/planner.md)."""
        if self.allocator == "share" or METHODS[method].streamed:
            return False
        return self.allocator == "replay" or not (mode == "step" and self.setup.device_state_made_at_first_step)

    def budget_of(self, method: str, mode: str) -> int:
        """The device budget ``method``'s longest T in ``mode`` is planned against: where the default
        reserve left the fragmentation share to the replay and ``method`` is not replayed, it keeps
        the share."""
        if self.allocator != "share" and not self.replayed(method, mode):
            return self.budget - int(CudaReserve().fragmentation * self.memory)
        return self.budget


def run_plan(request: PlanRequest, config, progress: bool = True, workers: int | None = 1) -> dict:
    """Every (mode, method, T) peak of one rank with its step time, and every (mode, method)
    longest T with the budget that stops it, as plain data. ``workers``: processes that plan the
    methods side by side (None: one per CPU this process may use; ``leanbp plan``'s default). A
    method's plan needs nothing from another's, and its fake steps keep one core busy in Python's
    dispatch, so two cores plan two methods in the time of the longer one. The processes start
    from a fresh server and import the caller's main module, as ``multiprocessing`` does: a script
    that asks for more than one calls ``run_plan`` under ``if __name__ == "__main__":``."""
    from tqdm import tqdm

    if workers is not None and (not isinstance(workers, int) or workers < 1):
        raise ValueError(f"workers must be a positive number of processes, got {workers!r}")
    started = time.perf_counter()
    planner = _planner(request, config)
    workers = min(len(request.methods), workers or _cpus())
    bar = tqdm(total=len(request.methods), desc="leanbp plan", unit="method", disable=not progress)
    with contextlib.ExitStack() as stack:
        if workers == 1:  # (lazily, each method as the loop below asks for it)
            planned = (_plan_method(request, planner, method, bar.set_postfix_str) for method in request.methods)
        else:
            bar.set_postfix_str(f"{workers} processes")
            # (forkserver: each process forks from a fresh server, not from this one with its threads)
            context = multiprocessing.get_context(
                "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn")
            pool = stack.enter_context(context.Pool(workers, initializer=_end_with, initargs=(os.getpid(),)))
            planned = pool.imap(_plan_method_alone, [(request, config, method) for method in request.methods])
        # (the rank's bytes here, while a pool plans the methods; one process reuses its fake models)
        rank, parameters = planner.rank(), planner.trainable_params()
        parts = []
        for part in planned:
            parts.append(part)
            bar.update()
    bar.close()
    return {"request": asdict(request), "budget": request.budget, "parameters": parameters,
            "setup": request.setup.describe(), "gpu": asdict(GPUS[request.setup.gpu]),
            "rank": asdict(rank), "seconds": time.perf_counter() - started,
            "peaks": [p for peaks, _ in parts for p in peaks], "longest": [r for _, longest in parts for r in longest]}


def _cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _planner(request: PlanRequest, config) -> Planner:
    return Planner(config, dtype=request.dtype, batch=request.batch, stream=request.stream,
                   hold_outputs=request.hold_outputs, free_grads=request.free_grads, lora_rank=request.lora_rank,
                   quantize=request.quantize, setup=request.setup)


def _end_with(pid: int) -> None:
    """A pool process's start: it leaves Ctrl-C to the plan's process (which ends the pool) and ends
    itself within a second of that process being gone (killed, it cannot end the pool), so no
    process plans on for a plan nobody reads."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch():
        while True:
            time.sleep(1)
            try:
                os.kill(pid, 0)
            except (ProcessLookupError, PermissionError):  # (PermissionError: another user's process has the number)
                os._exit(1)

    threading.Thread(target=watch, name="leanbp-plan-watch", daemon=True).start()


def _plan_method_alone(args) -> tuple[list, list]:
    """``_plan_method`` in a process of its own (a pool's)."""
    request, config, method = args
    return _plan_method(request, _planner(request, config), method, lambda status: None)


def _plan_method(request: PlanRequest, planner: Planner, method: str, status) -> tuple[list, list]:
    """(every (mode, T) peak, every mode's longest T) of one method; ``status`` is told what runs."""
    peaks, longest = [], []
    planner.lines(method, progress=lambda m, T: status(f"{m}: fake step at T={T}"))
    for mode in request.modes:
        optimizer = mode == "step"
        for T in request.seq_lens:
            peak = planner.peak(method, T, optimizer)
            peaks.append(dict(mode=mode, **_flat(peak), total=peak.total))
        status(f"{method}: longest T ({mode})")
        replayed = request.replayed(method, mode)
        if replayed:
            found = planner.longest_allocated(method, request.budget, optimizer)
        else:
            found = planner.longest(method, request.budget_of(method, mode), optimizer)
        at = planner.time(method, found.seq_len, optimizer) if found.seq_len else None
        longest.append(dict(mode=mode, method=method, max_seq_len=found.seq_len, checked=found.checked,
                            bound=found.bound, device_seq_len=found.device_seq_len,
                            host_seq_len=found.host_seq_len, budget=request.budget_of(method, mode),
                            replayed=replayed, step_s=at.total if at else None,
                            tokens_per_s=at.tokens_per_s if at else None))
    return peaks, longest


def _flat(peak) -> dict:
    """A ``Peak`` as one CSV-friendly row (the step time by part, flattened)."""
    row = {k: v for k, v in asdict(peak).items() if k != "time"}
    t = peak.time
    row.update(step_s=t.total, compute_s=t.compute, memory_s=t.memory, comm_s=t.comm, exchange_s=t.exchange,
               offload_s=t.offload, optimizer_s=t.optimizer, tokens_per_s=t.tokens_per_s, flops=t.flops)
    return row


def _gib(x: float) -> str:
    return f"{x / GiB:.1f}"


def _seconds(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3g}" if x < 100 else f"{x:,.0f}"


_OPTIMIZER_NOTE = {
    "adamw": "AdamW: two fp32 moments, and an fp32 master copy of 16-bit weights",
    "adamw-bf16": "AdamW with bf16 moments and no master copy (torch AdamW on bf16 weights)",
    "adamw-8bit": "bitsandbytes AdamW8bit: uint8 moments, an fp32 absmax per 256",
    "host": "AdamW on the host: moments, fp32 master and fp32 gradients in host memory, 0 on the device",
}


def format_plan(result: dict) -> str:
    req = result["request"]
    setup = req["setup"]
    gpus = setup["gpus"]
    base = f" over {req['quantize']} base weights (QLoRA)" if req.get("quantize", "none") != "none" else ""
    tuning = (f"LoRA r={req['lora_rank']} on every linear layer ({result['parameters'] / 1e6:.1f} M trainable "
              f"parameters){base}" if req["lora_rank"] else f"full fine-tuning ({result['parameters'] / 1e9:.2f} B "
              "parameters)")
    lines = [
        f"leanbp plan: {req['model']}, {tuning}"
        + f", {req['dtype']}, batch {req['batch']}{' per rank' if gpus > 1 else ''}; {result['setup']}; device memory "
        f"{_gib(req['memory'])} GiB - reserve {_gib(req['reserve'])} GiB ({req['reserve_note']}); leanbp chunk "
        f"{req['stream']['chunk_size']} rows; outputs "
        f"{'held through' if req['hold_outputs'] else 'dropped before'} backward; gradients "
        f"{'freed between steps' if req['free_grads'] else 'resident through the step'} ({result['seconds']:.0f} s)",
        "",
        f"Peak device memory of {'one rank' if gpus > 1 else 'the GPU'}, GiB (step = backprop + "
        f"{_OPTIMIZER_NOTE[setup['optimizer']]}; buffers = the engine's; host = offload and the optimizer on the "
        "host, this rank; * = from the phases' lines, not a fake step at that T; phase = where the peak is), "
        f"and the step's time on {result['gpu']['label']} at efficiency {setup['efficiency']:g}:",
        "",
        "| mode | method | T | weights | grads | optimizer | buffers | activations | total | host | fits | phase | "
        "step s | tokens/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    budget = result["budget"]
    host_budget = setup["host_memory"] / gpus
    by = {(r["mode"], r["method"]): r for r in result["longest"]}
    for p in result["peaks"]:
        found = by[(p["mode"], p["method"])]
        # (a replayed method fits up to its longest T: the allocator's model, not the tensors, decides)
        device = p["seq_len"] <= found["device_seq_len"] if found.get("replayed") else \
            p["total"] <= found.get("budget", budget)
        fits = device and p["host"] <= host_budget
        lines.append(
            f"| {p['mode']} | {METHODS[p['method']].label} | {p['seq_len']:,}{'' if p['probed'] else '*'} | "
            f"{_gib(p['weights'])} | {_gib(p['grads'])} | {_gib(p['optimizer'])} | {_gib(p['buffers'])} | "
            f"{_gib(p['activations'])} | {_gib(p['total'])} | {_gib(p['host']) if p['host'] else '-'} | "
            f"{'yes' if fits else 'no (host)' if device else 'no'} | {p['phase']} | "
            f"{_seconds(p['step_s'])} | {p['tokens_per_s']:,.0f} |")
    lines += ["", f"Longest sequence that fits {_gib(budget)} GiB of device memory per rank and "
                  f"{_gib(setup['host_memory'])} GiB of host memory for all {gpus} rank{'s' if gpus > 1 else ''} (a "
                  "multiple of 256; * = from the phases' lines, a fake step at that T too long to run; (host) = the host "
                  "memory stops it first), with the step's time there:", "",
              "| method | " + " | ".join(f"{m} T | {m} step s" for m in req["modes"]) + " |",
              "|---|" + "---|---|" * len(req["modes"])]
    for method in req["methods"]:
        cells = []
        for m in req["modes"]:
            r = by[(m, method)]
            cells.append(f"{r['max_seq_len']:,}{'' if r['checked'] else '*'}{' (host)' if r['bound'] == 'host' else ''}"
                         f"{' †' if r.get('replayed') else ''}")
            cells.append(_seconds(r["step_s"]))
        lines.append(f"| {METHODS[method].label} | " + " | ".join(cells) + " |")
    if any(r.get("replayed") for r in result["longest"]):
        note = (f"† two steps played through the model of PyTorch's CUDA caching allocator fit {_gib(budget)} GiB (it "
                "needs more than the tensors: segments stay cached, or split when a larger request comes)")
        shared = [r for r in result["longest"] if not r.get("replayed")]
        if shared:
            note += (f"; the others' tensors fit {_gib(shared[0]['budget'])} GiB, a share of the memory held back for "
                     "the allocator")
        lines += ["", note]
    return "\n".join(lines)


_CSV_FIELDS = ["mode", "method", "seq_len", "weights", "grads", "optimizer", "buffers", "activations", "total",
               "host", "probed", "phase", "step_s", "compute_s", "memory_s", "comm_s", "offload_s", "optimizer_s",
               "tokens_per_s", "flops"]


def write_plan(result: dict, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(result, indent=2))
    with open(out / "plan.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=_CSV_FIELDS)
        w.writeheader()
        w.writerows({k: p[k] for k in w.fieldnames} for p in result["peaks"])
    (out / "plan.md").write_text(format_plan(result) + "\n")
    _plot(result, out / "plan.png")
    return out


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    req = result["request"]
    modes = req["modes"]
    fig, axes = plt.subplots(2, len(modes), figsize=(6.2 * len(modes), 8.4), squeeze=False, sharex="col")
    longest = {(r["mode"], r["method"]): r["max_seq_len"] for r in result["longest"]}
    setup = req["setup"]
    where = f"{setup['gpus']} x {result['gpu']['label']}, {setup['engine']}, {setup['optimizer']}"
    for col, mode in enumerate(modes):
        memory_ax, time_ax = axes[0][col], axes[1][col]
        for method in req["methods"]:
            rows = [p for p in result["peaks"] if p["mode"] == mode and p["method"] == method]
            xs = [p["seq_len"] for p in rows]
            line, = memory_ax.plot(xs, [p["total"] / GiB for p in rows], marker="o",
                                   label=f"{METHODS[method].label} (max {longest[(mode, method)]:,})")
            time_ax.plot(xs, [p["step_s"] for p in rows], marker="o", color=line.get_color(),
                         label=METHODS[method].label)
            if longest[(mode, method)]:
                for ax in (memory_ax, time_ax):
                    ax.axvline(longest[(mode, method)], color=line.get_color(), linestyle=":", linewidth=1)
        # (a replayed method's budget is the allocator's memory, which its replay, not its tensors, fits)
        rows = [r for r in result["longest"] if r["mode"] == mode]
        for style, value in zip(("--", "-."), sorted({r.get("budget", result["budget"]) for r in rows}, reverse=True)):
            replayed = [METHODS[r["method"]].label for r in rows if r.get("replayed") and r["budget"] == value]
            memory_ax.axhline(value / GiB, color="black", linestyle=style, linewidth=1,
                              label=f"budget {value / GiB:.1f} GiB" + (f" (replayed: {', '.join(replayed)})"
                                                                       if replayed else ""))
        memory_ax.set_ylabel("peak device memory per rank (GiB)")
        tuning = ("" if not req["lora_rank"] else ", QLoRA" if req.get("quantize", "none") != "none" else ", LoRA")
        memory_ax.set_title(f"{req['model']}{tuning}, {req['dtype']}, batch "
                            f"{req['batch']}: {'backprop only' if mode == 'backprop' else 'full step'}\n{where}",
                            fontsize=9)
        time_ax.set_ylabel(f"step time (s), efficiency {setup['efficiency']:g}")
        time_ax.set_xlabel("sequence length T (tokens)")
        for ax in (memory_ax, time_ax):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
