"""Orchestrates benchmark cases (each in a subprocess) and writes the table, CSV and plot."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from dataclasses import InitVar, asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from .._dtypes import QUANTIZE
from ..approx import VARIANTS
from ..memory import MiB
from ..streaming import METHODS, StreamConfig, old_chunk_sizes
from ._machine import machine
from ._models import BENCH_MODELS
from ._peers import PEERS
from ._trl_case import TRL_METHODS, TRL_OBJECTIVES

# fp32 or bf16 weights and compute, or mixed precision ("autocast": fp32 weights, bf16 compute)
BENCH_DTYPES = ("fp32", "bf16", "autocast")


def _check_list(name: str, values, allowed: tuple = ()) -> None:
    """A non-empty list of ``allowed`` names, or of positive integers. Bad settings are an error
    before any case runs (never an error row and exit 0)."""
    if not values:
        raise ValueError(f"{name} is empty")
    bad = [v for v in values if (v not in allowed if allowed else not (isinstance(v, int) and v > 0))]
    if bad:
        raise ValueError(f"{name}: {bad} not allowed; " + (f"choose from {list(allowed)}" if allowed else
                                                          "use positive integers"))


def _check_positive(case, *names: str) -> None:
    for name in names:
        value = getattr(case, name)
        if not (isinstance(value, int) and value > 0):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


# what every method of the stream and peers suites is called in tables and plots
LABELS = {**{name: m.label for name, m in METHODS.items()}, **{name: p.label for name, p in PEERS.items()}}
# the peers suite: leanbp against the strongest exact single-device recipes, ALST's the baseline
# (each case's time: the median of its 3 rounds, one timed step each after the measured one)
PEERS_SUITE = dict(methods=["ckpt", "ckpt_tiled_loss", "alst", "leanbp"], seq_lens=[8192, 16384], rounds=3,
                   timed_steps=1)


@dataclass
class BenchCase:
    seq_lens: list[int] = field(default_factory=lambda: [2048, 4096, 8192, 16384])
    methods: list[str] = field(default_factory=lambda: ["plain", "ckpt", "leanbp"])  # METHODS, or PEERS
    model: str = "qwen3"  # the bench shape as qwen3, gemma3 or qwen3_moe (``_models.bench_config``)
    batch: int = 1
    dtype: str = "fp32"
    device: str = "cpu"
    stream: StreamConfig = field(default_factory=StreamConfig)  # the streamed methods' settings
    quantize: str = "none"  # "nf4": QLoRA (the base in bitsandbytes' 4 bits, LoRA r=8 on every linear)
    timed_steps: int = 3  # step time: the median of this many steps after the measured one
    # every case this many times, each round in the other order; a case's time is its rounds' median
    rounds: int = 1
    timeout_s: int = 3600
    # deprecated: the chunk sizes before ``stream`` carried them
    chunk_size: InitVar[int | str | None] = None
    head_chunk_size: InitVar[int | None] = None

    def __post_init__(self, chunk_size, head_chunk_size):
        self.stream = old_chunk_sizes(self, self.stream, chunk_size, head_chunk_size)
        _check_list("seq_lens", self.seq_lens)
        _check_list("methods", self.methods, (*METHODS, *PEERS))
        _check_list("model", [self.model], BENCH_MODELS)
        _check_list("dtype", [self.dtype], BENCH_DTYPES)
        _check_list("quantize", [self.quantize], QUANTIZE)
        if self.quantize != "none" and set(self.methods) & set(PEERS):
            raise ValueError(f"quantize={self.quantize!r} is measured for leanbp's methods, not the peers "
                             f"{sorted(set(self.methods) & set(PEERS))}")
        _check_positive(self, "batch", "timed_steps", "rounds")


def _run_one(spec: dict, timeout_s: int) -> dict:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "leanbp.bench._case", json.dumps(spec)],
            capture_output=True, text=True, timeout=timeout_s, env=env,
        )
    except subprocess.TimeoutExpired:
        return {**spec, "error": f"timeout after {timeout_s}s"}
    for line in proc.stdout.splitlines():
        if line.startswith("LEANBP_CASE "):
            return json.loads(line[len("LEANBP_CASE "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return {**spec, "error": f"exit {proc.returncode}: {tail[0][:200]}"}


def run_bench(case: BenchCase, out_dir: str | Path, progress: bool = True, name: str = "bench",
              baseline: str = "ckpt") -> list[dict]:
    """Every method at every T, each case in its own process (``case.rounds`` times); writes
    ``<name>.csv``, ``<name>.json`` and ``<name>.png``; ratios to ``baseline`` (and to checkpointing)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # the order of the methods alternates from one T to the next and from one round to the next:
    # none always runs first (or after the heaviest case), which moved single timings by +-5% on a
    # shared machine
    specs = [
        {"method": m, "seq_len": T, "model": case.model, "batch": case.batch, "dtype": case.dtype, "device": case.device,
         "stream": asdict(case.stream), "timed_steps": case.timed_steps, "quantize": case.quantize}
        for r in range(case.rounds) for i, T in enumerate(case.seq_lens)
        for m in (case.methods if (i + r) % 2 == 0 else case.methods[::-1])
    ]
    rounds = []
    bar = tqdm(specs, desc="bench", disable=not progress, unit="case")
    for spec in bar:
        bar.set_postfix_str(f"{spec['method']} T={spec['seq_len']}")
        rounds.append(_run_one(spec, case.timeout_s))
    rows = _median_of_rounds(rounds)
    rows.sort(key=lambda r: (case.seq_lens.index(r["seq_len"]), case.methods.index(r["method"])))
    for base in dict.fromkeys(("ckpt", baseline)):
        _add_ratios(rows, base, is_base=lambda r, b=base: r["method"] == b, group=lambda r: r["seq_len"])
    write_csv(rows, out_dir / f"{name}.csv", baseline)
    (out_dir / f"{name}.json").write_text(json.dumps({"case": asdict(case), "machine": machine(), "rows": rows},
                                                     indent=1))
    plot(rows, out_dir / f"{name}.png")
    return rows


def _median_of_rounds(results: list[dict]) -> list[dict]:
    """One row per (method, T): the round with the median step time (memory is the same in every
    round), with every round's time in ``step_s_rounds``; a case that failed in any round is its error."""
    by_case: dict[tuple, list[dict]] = {}
    for r in results:
        by_case.setdefault((r["method"], r["seq_len"]), []).append(r)
    rows = []
    for runs in by_case.values():
        failed = [r for r in runs if "error" in r]
        if failed:
            rows.append(failed[0])
            continue
        runs = sorted(runs, key=lambda r: r["step_s"])
        rows.append({**runs[(len(runs) - 1) // 2], "step_s_rounds": [r["step_s"] for r in runs]})
    return rows


@dataclass
class ApproxBenchCase:
    """Approx-BP / MS-BP rows: Llama-shaped model, no checkpointing, exact vs approximations.

    Every row uses leanbp's chunked LM-head loss on transformers' own decoder (``method="head"``),
    so the full logits, identical in every row, do not mask the layers' activation memory.
    ``dtype="autocast"`` is mixed precision (fp32 parameters, bf16 compute), the usual fine-tuning
    setup; step time is the median of ``timed_steps`` steps."""

    seq_lens: list[int] = field(default_factory=lambda: [512, 1024, 2048])
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    lora: list[bool] = field(default_factory=lambda: [False, True])
    batch: int = 4
    method: str = "head"
    dtype: str = "autocast"
    stream: StreamConfig = field(default_factory=StreamConfig)  # the streamed methods' settings
    timed_steps: int = 3
    device: str = "cpu"
    timeout_s: int = 3600

    def __post_init__(self):
        _check_list("seq_lens", self.seq_lens)
        _check_list("variants", self.variants, VARIANTS)
        _check_list("method", [self.method], tuple(METHODS))
        _check_list("dtype", [self.dtype], BENCH_DTYPES)
        _check_positive(self, "batch", "timed_steps")


def run_approx_bench(case: ApproxBenchCase, out_dir: str | Path, progress: bool = True) -> list[dict]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    specs = [{"model": "llama", "method": case.method, "approx": v, "lora": lora, "seq_len": T, "batch": case.batch,
              "dtype": case.dtype, "stream": asdict(case.stream), "timed_steps": case.timed_steps,
              "device": case.device}
             for lora in case.lora for T in case.seq_lens for v in case.variants]
    rows = []
    bar = tqdm(specs, desc="bench approx", disable=not progress, unit="case")
    for spec in bar:
        bar.set_postfix_str(f"{'lora' if spec['lora'] else 'full'} T={spec['seq_len']} {spec['approx']}")
        rows.append(_run_one(spec, case.timeout_s))
    _add_ratios(rows, "exact", is_base=lambda r: r["approx"] == "none", group=lambda r: (r["lora"], r["seq_len"]))
    (out_dir / "bench_approx.json").write_text(json.dumps({"case": asdict(case), "machine": machine(), "rows": rows},
                                                          indent=1))
    with open(out_dir / "bench_approx.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["fine_tuning", "seq_len", "approx", "act_mib", "step_s", "act_vs_exact", "time_vs_exact", "error"])
        for r in rows:
            w.writerow(["lora" if r["lora"] else "full", r["seq_len"], r["approx"],
                        round(r["activations"] / MiB, 1) if "activations" in r else "",
                        round(r["step_s"], 3) if "step_s" in r else "",
                        round(r.get("act_vs_exact", float("nan")), 3), round(r.get("time_vs_exact", float("nan")), 3),
                        r.get("error", "")])
    return rows


@dataclass
class TrlBenchCase:
    """TRL's SFT (packed), DPO (2 pairs) and GRPO (a group of 4) trainers on the bench model, with
    their default gradient checkpointing vs streamed by leanbp. The order of the two methods
    alternates from one sequence length to the next."""

    seq_lens: dict[str, list[int]] = field(default_factory=lambda: {"sft": [4096, 16384], "dpo": [2048, 8192],
                                                                    "grpo": [2048, 8192]})
    methods: list[str] = field(default_factory=lambda: list(TRL_METHODS))
    timed_steps: int = 3
    stream: StreamConfig = field(default_factory=StreamConfig)  # leanbp's settings (its head's, for ckpt_head)
    device: str = "cpu"  # cpu, or cuda: the trainers' accelerator places the model
    timeout_s: int = 7200
    # deprecated: the chunk sizes before ``stream`` carried them
    chunk_size: InitVar[int | str | None] = None
    head_chunk_size: InitVar[int | None] = None

    def __post_init__(self, chunk_size, head_chunk_size):
        self.stream = old_chunk_sizes(self, self.stream, chunk_size, head_chunk_size)
        _check_list("objectives", list(self.seq_lens), TRL_OBJECTIVES)
        for objective, lengths in self.seq_lens.items():
            _check_list(f"seq_lens[{objective}]", lengths)
        _check_list("methods", self.methods, tuple(TRL_METHODS))
        _check_positive(self, "timed_steps")


def run_trl_bench(case: TrlBenchCase, out_dir: str | Path, progress: bool = True) -> list[dict]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    specs = []
    for objective, lengths in case.seq_lens.items():
        for i, T in enumerate(lengths):
            order = case.methods if i % 2 == 0 else case.methods[::-1]  # no method always runs first
            specs += [{"suite": "trl", "objective": objective, "method": m, "seq_len": T,
                       "timed_steps": case.timed_steps, "stream": asdict(case.stream), "device": case.device}
                      for m in order]
    rows = []
    bar = tqdm(specs, desc="bench trl", disable=not progress, unit="case")
    for spec in bar:
        bar.set_postfix_str(f"{spec['objective']} {spec['method']} T={spec['seq_len']}")
        rows.append(_run_one(spec, case.timeout_s))
        _write_trl(case, rows, out_dir)  # after every case: an hour-long run killed late keeps what it measured
    return _write_trl(case, rows, out_dir)


def _write_trl(case: TrlBenchCase, rows: list[dict], out_dir: Path) -> list[dict]:
    order = {o: i for i, o in enumerate(case.seq_lens)}
    rows = sorted(rows, key=lambda r: (order[r["objective"]], r["seq_len"], case.methods.index(r["method"])))
    _add_ratios(rows, "ckpt", is_base=lambda r: r["method"] == "ckpt", group=lambda r: (r["objective"], r["seq_len"]))
    (out_dir / "bench_trl.json").write_text(json.dumps({"case": asdict(case), "machine": machine(), "rows": rows},
                                                       indent=1))
    with open(out_dir / "bench_trl.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["objective", "seq_len", "tokens", "method", "act_mib", "step_s", "act_vs_ckpt", "time_vs_ckpt",
                    "error"])
        for r in rows:
            w.writerow([r["objective"], r["seq_len"], r.get("tokens", ""), r["method"],
                        round(r["activations"] / MiB, 1) if "activations" in r else "",
                        round(r["step_s"], 3) if "step_s" in r else "",
                        round(r.get("act_vs_ckpt", float("nan")), 3), round(r.get("time_vs_ckpt", float("nan")), 3),
                        r.get("error", "")])
    plot_trl(rows, out_dir / "bench_trl.png")
    return rows




def format_trl_table(rows: list[dict]) -> str:
    return markdown_table(
        ["trainer", "T", "tokens / step", "method", "activation MiB", "step s", "act / ckpt", "time / ckpt"], rows,
        key=lambda r: [TRL_OBJECTIVES[r["objective"]], r["seq_len"], r.get("tokens", ""), TRL_METHODS[r["method"]]],
        values=lambda r: [f"{r['activations'] / MiB:.1f}", f"{r['step_s']:.1f}", _ratio(r.get("act_vs_ckpt", "")),
                          _ratio(r.get("time_vs_ckpt", ""))])


def plot_trl(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    objectives = list(dict.fromkeys(r["objective"] for r in rows))
    fig, axes = plt.subplots(2, len(objectives), figsize=(4.2 * len(objectives), 6.5), squeeze=False)
    for col, objective in enumerate(objectives):
        for method, style in (("ckpt", "o--"), ("ckpt_head", "s:"), ("leanbp", "o-")):
            ok = sorted((r for r in rows if r["objective"] == objective and r["method"] == method and "error" not in r),
                        key=lambda r: r["seq_len"])
            if not ok:  # (a method whose every case failed: its rows say why)
                continue
            T = [r["seq_len"] for r in ok]
            axes[0][col].plot(T, [r["activations"] / MiB for r in ok], style, label=TRL_METHODS[method])
            axes[1][col].plot(T, [r["step_s"] for r in ok], style, label=TRL_METHODS[method])
        axes[0][col].set_title(TRL_OBJECTIVES[objective], fontsize=10)
        axes[0][col].set_ylabel("activation MiB (peak - params - grads)")
        axes[1][col].set_ylabel("backprop step s (median)")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length T")
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_legend_handles_labels()[0]:  # (none where every case failed: the rows say why)
                ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


APPROX_LABELS = {"none": "exact", "act": "ReSiLU2 only", "norm": "MS-RMSNorm only", "both": "ReSiLU2 + MS-RMSNorm",
                 "inverted": "Inverted SiLU only", "inverted+norm": "Inverted SiLU + MS-RMSNorm"}


def format_approx_table(rows: list[dict]) -> str:
    return markdown_table(
        ["fine-tuning", "T", "backward", "activation MiB", "step s", "act / exact", "time / exact"], rows,
        key=lambda r: ["LoRA r=8" if r["lora"] else "full", r["seq_len"], APPROX_LABELS[r["approx"]]],
        values=lambda r: [f"{r['activations'] / MiB:.1f}", f"{r['step_s']:.2f}", _ratio(r.get("act_vs_exact", "")),
                          _ratio(r.get("time_vs_exact", ""))])


def markdown_table(header: list[str], rows: list[dict], key, values) -> str:
    """A Markdown table (it goes into the docs as is): ``key(row)`` cells, then ``values(row)``
    cells, or the row's error in their place."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        k = key(r)
        v = values(r) if not r.get("error") else [r["error"]] + [""] * (len(header) - len(k) - 1)
        lines.append("| " + " | ".join(str(c) for c in [*k, *v]) + " |")
    return "\n".join(lines)


def _add_ratios(rows: list[dict], name: str, is_base, group) -> None:
    """Each row's activation memory and time relative to the baseline row of its group, as
    ``act_vs_<name>`` and ``time_vs_<name>`` (rows without a successful baseline get none)."""
    bases = {group(r): r for r in rows if is_base(r) and "error" not in r}
    for r in rows:
        base = bases.get(group(r))
        if base is None or "error" in r:
            continue
        r[f"act_vs_{name}"] = r["activations"] / base["activations"]
        r[f"time_vs_{name}"] = r["step_s"] / base["step_s"]


def _ratio_keys(baseline: str) -> list[str]:
    """act_vs_ckpt, time_vs_ckpt (and the same against ``baseline``)."""
    return [f"{kind}_vs_{b}" for b in dict.fromkeys(("ckpt", baseline)) for kind in ("act", "time")]


def _columns(baseline: str) -> list[str]:
    return ["method", "seq_len", "chunk_rows", "peak_mib", "params_mib", "grads_mib", "act_mib", "host_mib", "step_s",
            *_ratio_keys(baseline), "error"]


def _flat(r: dict, baseline: str = "ckpt") -> dict:
    out = {"method": r["method"], "seq_len": r["seq_len"], "chunk_rows": r.get("chunk_rows") or "",
           "error": r.get("error", "")}
    for key, col in (("peak", "peak_mib"), ("params", "params_mib"), ("grads", "grads_mib"),
                     ("activations", "act_mib"), ("host", "host_mib")):
        out[col] = round(r[key] / MiB, 1) if key in r else ""
    for key in ("step_s", *_ratio_keys(baseline)):
        out[key] = round(r[key], 3) if key in r else ""
    return out


def write_csv(rows: list[dict], path: Path, baseline: str = "ckpt") -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=_columns(baseline))
        w.writeheader()
        for r in rows:
            w.writerow(_flat(r, baseline))


def format_table(rows: list[dict], baseline: str = "ckpt") -> str:
    """The stream suite's table (ratios to checkpointing), or the peers suite's (also to ``baseline``)."""
    extra = [] if baseline == "ckpt" else [f"act / {baseline}", f"time / {baseline}"]
    return markdown_table(
        ["T", "method", "chunk", "peak MiB", "activation MiB", "host MiB", "step s", "act / ckpt", "time / ckpt",
         *extra], rows,
        key=lambda r: [r["seq_len"], LABELS[r["method"]] if extra else r["method"], r.get("chunk_rows") or ""],
        values=lambda r: [(f := _flat(r, baseline))["peak_mib"], f["act_mib"], f["host_mib"] or "-",
                          f"{r['step_s']:.1f}", _ratio(f["act_vs_ckpt"]), _ratio(f["time_vs_ckpt"]),
                          *([_ratio(f[f"act_vs_{baseline}"]), _ratio(f[f"time_vs_{baseline}"])] if extra else [])])


def _ratio(x) -> str:
    return f"{x:.3f}" if x != "" else ""


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(11, 4.2))
    for method in dict.fromkeys(r["method"] for r in rows):
        ok = sorted((r for r in rows if r["method"] == method and "error" not in r), key=lambda r: r["seq_len"])
        if not ok:
            continue
        T = [r["seq_len"] for r in ok]
        ax_mem.plot(T, [r["activations"] / MiB for r in ok], marker="o", label=LABELS[method])
        ax_time.plot(T, [r["step_s"] for r in ok], marker="o", label=LABELS[method])
    for ax, title, unit in ((ax_mem, "activation memory (peak - params - grads)", "MiB"),
                            (ax_time, "training step time (forward + backward)", "seconds")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
        ax.set_ylabel(unit)
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    quantized = {r.get("quantize", "none") for r in rows} - {"none"}
    if quantized:
        fig.suptitle(f"QLoRA: {', '.join(sorted(quantized))} base weights, LoRA r=8 on every linear layer",
                     fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
