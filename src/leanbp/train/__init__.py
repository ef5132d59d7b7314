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
    _engines.py         one process, DDP, FSDP2, ZeRO-2/3; the --nproc launcher
"""

from ._byte_tokenizer import byte_tokenizer
from ._config import OBJECTIVES, TRAIN_DTYPES, NonFiniteError, TrainConfig
from ._data import TokenData, builtin_records, bundled_text, continuation_reward, load_tokenizer, read_jsonl, verses
from ._engines import ENGINES, launch, launched_by_torchrun, make_engine
from ._loop import train
from ._models import TRAIN_QWEN3, build_model, load_model, qwen3_config
from ._outputs import plot_losses

__all__ = ["ENGINES", "NonFiniteError", "OBJECTIVES", "TRAIN_DTYPES", "TRAIN_QWEN3", "TokenData",
           "TrainConfig", "build_model", "builtin_records", "bundled_text", "byte_tokenizer", "continuation_reward",
           "launch", "launched_by_torchrun", "load_model", "make_engine", "load_tokenizer", "plot_losses", "qwen3_config",
           "read_jsonl", "train", "verses"]
