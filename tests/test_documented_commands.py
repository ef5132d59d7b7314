"""Every `leanbp ...` command in a fenced shell block of the README and the docs pages runs.

A documented command that no longer parses, names an option or a choice that is gone, or fails when
it runs, fails here. Each runs through the real command line with only its size turned down, so that
all of them fit the suite's time budget:

* ``--out`` goes to a temporary folder; ``leanbp train`` runs ``--steps 2``;
* ``leanbp bench`` runs its sequence lengths at 64 tokens and one timed step (where the suite
  offers ``--timed-steps``), on the bench models shrunk to 2 layers of width 64 (vocabulary 512),
  each case in this process instead of one of its own (the subprocess path has its own tests);
* ``leanbp plan`` plans a preset with 2 of its layers (the planner's cost grows with the layers);
* ``--model path/to/...`` (a placeholder) is a tiny model's config.json.

A command that needs what CI lacks says so at the end of its line (``# needs a GPU``) and is skipped
with that reason. ``--nproc`` commands launch their processes as written; the DeepSpeed ones run with
DeepSpeed's fp16 probe answered both ways (it decides how ZeRO-3 partitions a float64 model).
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex

import pytest
import transformers

from _helpers import REPO, TINY_SHAPE, forced_probes

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
NEEDS = re.compile(r"#\s*needs (a GPU|[\w -]+)$")


def documented_commands() -> list[tuple[str, str, str | None]]:
    """(page, command line, what it needs or None) of every `leanbp` command in a fenced shell block
    (a line may chain commands with &&: each `leanbp` one counts)."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for block in re.finditer(r"^```(?:bash|sh|shell|console)\n(.*?)^```", text, re.S | re.M):
            for line in block.group(1).replace("\\\n", " ").splitlines():
                needs = NEEDS.search(line.strip())
                words = shlex.split(line, comments=True)
                commands, current = [], []
                for word in words + ["&&"]:
                    if word in ("&&", ";", "||"):
                        commands.append(current)
                        current = []
                    else:
                        current.append(word)
                for command in commands:
                    if command[:1] == ["leanbp"]:
                        found.append((page.name, shlex.join(command), needs.group(1) if needs else None))
    return found


COMMANDS = documented_commands()


def test_the_docs_document_commands():
    """The collector finds the commands (a test over nothing would pass)."""
    pages = {page for page, _, _ in COMMANDS}
    assert {"README.md", "multi-gpu.md", "planner.md", "benchmarks.md"} <= pages
    assert len(COMMANDS) >= 10


def _set(words: list[str], option: str, value: str) -> list[str]:
    if option in words:
        words[words.index(option) + 1] = value
        return words
    return words + [option, value]


def _sized(words: list[str], tmp_path, name: str) -> tuple[list[str], str]:
    """The command with its size turned down; returns it and its output folder."""
    command = words[1]
    out = str(tmp_path / name)
    words = _set(list(words), "--out", out)
    for i, word in enumerate(words):
        if word.startswith("path/to/"):
            if words[i - 1] != "--model":
                raise AssertionError(f"no stand-in for the placeholder {word} after {words[i - 1]}")
            config = tmp_path / "tiny_model" / "config.json"
            transformers.Qwen3Config(**TINY_SHAPE).save_pretrained(config.parent)
            words[i] = str(config)
    if command == "train":
        words = _set(words, "--steps", "2")
    elif command == "bench":
        suite = words[words.index("--suite") + 1] if "--suite" in words else "stream"
        words = _set(words, "--seq-lens", "sft=64,dpo=64,grpo=64" if suite == "trl" else "64")
        if suite != "approx":
            words = _set(words, "--timed-steps", "1")
    return words, out


@pytest.mark.parametrize("page, line, needs", COMMANDS, ids=[f"{p}:{' '.join(l.split()[1:3])}-{i}"
                                                           for i, (p, l, _) in enumerate(COMMANDS)])
def test_a_documented_command_runs(tmp_path, monkeypatch, small_cases, page, line, needs):
    from leanbp.cli import main

    if needs is not None:
        pytest.skip(f"{page}: `{line}` needs {needs}")
    words = shlex.split(line)
    deepspeed = any(w.startswith("zero") for w in words)
    if deepspeed and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs deepspeed")
    for probe in (False, True) if deepspeed else (None,):
        if probe is not None:  # (the launched ranks inherit this environment)
            env = forced_probes(probe)
            for key in ("PYTHONPATH", "LEANBP_TEST_DEEPSPEED_FP16"):
                monkeypatch.setenv(key, env[key])
        run, out = _sized(words, tmp_path, f"out-{probe}")
        assert main(run[1:]) == 0, f"{page}: {shlex.join(run)}"
        if run[1] == "bench":  # a case that failed is a row with its error, not an exit code
            results = [json.loads(p.read_text()) for p in (tmp_path / f"out-{probe}").glob("bench*.json")]
            rows = [row for result in results for row in result["rows"]]
            assert rows and not [row.get("error") for row in rows if row.get("error")], page
        if run[1] == "train" and "--nproc" in run:
            assert (tmp_path / f"out-{probe}" / "final" / "config.json").exists()
