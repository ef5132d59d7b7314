"""Hardware probes answered as a test says, in every Python process it starts.

The suite runs the code paths that depend on what the machine reports both ways, whatever this
machine reports: ``forced_probes`` (tests/_helpers.py) puts this folder on PYTHONPATH for the
processes a test starts, with the answers in the environment:

    LEANBP_TEST_DEEPSPEED_FP16=1|0   DeepSpeed's accelerator answers ``is_fp16_supported()`` so
                                     (the CPU accelerator asks oneDNN, a CUDA one the capability).
    LEANBP_TEST_PDEATHSIG=1|0        leanbp's ranks find Linux's parent-death signal available or
                                     not (without it they watch their parent from a thread, as on
                                     macOS).

Modules are patched when they load, not imported here: most processes never import them.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

_FORCED = os.environ.get("LEANBP_TEST_DEEPSPEED_FP16")
_PDEATHSIG = os.environ.get("LEANBP_TEST_PDEATHSIG")


class _PatchAccelerators(importlib.abc.MetaPathFinder):
    """Wraps the loader of every ``deepspeed.accelerator.*_accelerator`` module so that, once it has
    run, its accelerator classes answer the fp16 probe as forced."""

    def find_spec(self, name, path, target=None):
        if not (name.startswith("deepspeed.accelerator.") and name.endswith("_accelerator")):
            return None
        sys.meta_path.remove(self)  # (find the real spec without finding ourselves)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            for value in vars(module).values():
                if isinstance(value, type) and "is_fp16_supported" in vars(value):
                    value.is_fp16_supported = lambda self: _FORCED == "1"

        spec.loader.exec_module = exec_module
        return spec


class _PatchRanks(importlib.abc.MetaPathFinder):
    """Makes ``leanbp.train._ranks`` answer its parent-death-signal probe as forced."""

    def find_spec(self, name, path, target=None):
        if name != "leanbp.train._ranks":
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            module.parent_death_signal_available = lambda: _PDEATHSIG == "1"

        spec.loader.exec_module = exec_module
        return spec


if _FORCED in ("0", "1"):
    sys.meta_path.insert(0, _PatchAccelerators())
if _PDEATHSIG in ("0", "1"):
    sys.meta_path.insert(0, _PatchRanks())
