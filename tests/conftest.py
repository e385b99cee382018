"""Helpers for the tests: import a step's modules, and run a step's train.py under torchrun."""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

# No network here: the hub libraries fail at once instead of retrying for a minute.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
STEP_MODULES = [
    "model",
    "utils",
    "process_group_manager",
    "dataloader",
    "checkpoint",
    "tensor_parallel",
    "data_parallel",
    "pipeline_parallel",
    "train",
]
# A model small enough for a 2-core machine; the vocabulary comes from assets/configs/tiny.
TINY = [
    "--num_hidden_layers", "2", "--hidden_size", "64", "--intermediate_size", "128",
    "--num_attention_heads", "4", "--num_key_value_heads", "2",
    "--seq_len", "32", "--micro_batch_size", "2",
]  # fmt: skip


def import_step(step, name):
    """Import module `name` of step folder `step` (the steps share module names)."""
    for module in STEP_MODULES:
        sys.modules.pop(module, None)
    sys.path.insert(0, str(ROOT / step))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / step))


def run_step(step, args, nproc=1, timeout=300, env=None, torchrun=True):
    """Run step/train.py (under torchrun with `nproc` processes); returns the CompletedProcess."""
    script = str(ROOT / step / "train.py")
    if torchrun:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command = [*launcher, f"--nproc_per_node={nproc}", script, *args]
    else:
        command = [sys.executable, script, *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT
    )


def check(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def read_log(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]
