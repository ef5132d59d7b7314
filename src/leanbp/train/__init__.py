"""The application behind ``leanbp train``: a run's config, the loop, TRL's objectives, the data
and the built-in model, crash-safe checkpoints and the run folder, and the engines and launcher of
multi-process runs.

    _config.py          TrainConfig (every option of leanbp train), NonFiniteError
    _loop.py            train(): open the run, load, prepare, one step at a time, finish
    _trl.py             --objective sft | dpo | grpo: TRL's trainers on the streamed model
    _data.py            the bundled text, local .txt / .jsonl, the built-in post-training sets
    _models.py          the model a run trains (a local one, or the built-in Qwen3-shaped one)
    _byte_tokenizer.py  a tokenizer that needs nothing downloaded
    _checkpoint.py      checkpoints no crash can lose
    _outputs.py         run.json, train_log.csv, loss.png
    _safe_load.py       what --resume reads, with nothing unpickled that could run code
    _run_lock.py        one run folder, one owner (a kernel lock held for the run's life)
    _engines.py         one process, DDP, FSDP2, ZeRO-2/3
    _launcher.py        --nproc N: the run checked once, then torchrun's agent (_agent.py) and N ranks
    _ranks.py           the ranks die with their launcher; an error they all meet is said once
    _zo.py              --optimizer dpzero: DPZero's private steps (leanbp.zo) and their accounting
"""

from ._byte_tokenizer import byte_tokenizer
from ._config import OBJECTIVES, OPTIMIZERS, TRAIN_DTYPES, NonFiniteError, TrainConfig
from ._data import (CLASSIFY, TokenData, builtin_records, bundled_text, classify_records, continuation_reward,
                    load_tokenizer, read_jsonl, verses)
from ._engines import ENGINES, make_engine
from ._launcher import check_run, launch
from ._loop import train
from ._models import TRAIN_QWEN3, build_model, load_model, qwen3_config
from ._outputs import plot_losses
from ._ranks import first_to_report, launched_by_torchrun, several_processes
from ._run_lock import RunFolderBusy, RunLock
from ._zo import default_delta, privacy_summary

__all__ = ["CLASSIFY", "ENGINES", "NonFiniteError", "OBJECTIVES", "OPTIMIZERS", "RunFolderBusy", "RunLock",
           "TRAIN_DTYPES", "TRAIN_QWEN3", "TokenData", "TrainConfig", "build_model", "builtin_records", "bundled_text",
           "byte_tokenizer", "check_run", "classify_records", "continuation_reward", "default_delta",
           "first_to_report", "launch", "launched_by_torchrun", "load_model", "load_tokenizer", "make_engine",
           "plot_losses", "privacy_summary", "qwen3_config", "read_jsonl", "several_processes", "train", "verses"]
