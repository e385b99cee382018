"""Outside its technique, a training step makes one collective and one host sync: the step's facts
(the loss, whether it and the gradient norm are finite on every rank, whether SIGTERM came) travel
in one all-reduce over the world and are read in one `.tolist()` (`bookkeeping.agree`); no
collective runs on a group of one rank. On a GPU every read of a device value waits for the queue
to drain, and every collective is a launch and a wait.

A launcher wraps every torch.distributed call and every `Tensor.item` / `Tensor.tolist` before
train.main() runs, and writes each rank's counts for the run's second step (not the first, which
also counts the optimizer state, nor the last, which validates). The data loader's `.item()` reads
a row index from its shuffled order, a CPU tensor: not a wait on the device, and not counted.
"""

import json
import os
import subprocess
import time

import pytest
from conftest import LAUNCH, ROOT, TINY, check, step_dir

S6, S9, S11 = "step6_data_parallel_bucket", "step9_3d_parallel", "step11_context_parallel"
RUN = [*TINY, "--num_proc", "1", "--max_steps", "3", "--gradient_accumulation_steps", "2"]
RUN += ["--sample_tokens", "0", "--eval_steps", "1", "--eval_every", "0"]

COUNTER = """import collections
import json
import os
import sys
from pathlib import Path

step = Path(sys.argv[1]).resolve()
out = Path(sys.argv[2])
sys.path.insert(0, str(step))  # the step's modules
sys.argv = [str(step / "train.py"), *sys.argv[3:]]
import torch
import torch.distributed as dist
import bookkeeping
import train
import utils

counts, phase = collections.Counter(), [0]
CALLS = ["all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
         "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "send", "recv", "isend",
         "irecv", "batch_isend_irecv", "barrier"]


def counted(name, original):
    def call(*args, **kwargs):
        group = kwargs.get("group")
        group = group or next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
        size = dist.get_world_size(group)
        where = "world" if group in (None, dist.group.WORLD) else f"group of {{size}}"
        counts[phase[0], f"{{name}} on {{where}}"] += 1
        return original(*args, **kwargs)
    return call


for name in CALLS:
    setattr(dist, name, counted(name, getattr(dist, name)))


def host(name, original):
    def read(self, *args, **kwargs):
        if not sys._getframe(1).f_code.co_filename.endswith("dataloader.py"):
            counts[phase[0], "host sync"] += 1
        return original(self, *args, **kwargs)
    return read


for name in ["item", "tolist"]:
    setattr(torch.Tensor, name, host(name, getattr(torch.Tensor, name)))
begin = bookkeeping.Run.begin


def begin_step(self, step, *args):
    phase[0] = step
    return begin(self, step, *args)


bookkeeping.Run.begin = begin_step
try:
    utils.run_main(train.main)
finally:
    second = {{what: n for (step, what), n in counts.items() if step == 2}}
    (out / f"rank{{os.environ['RANK']}}.json").write_text(json.dumps(second))
"""


def count(tmp_path, step, args, nproc):
    """Each rank's calls in the second step: {"all_reduce on world": 1, "host sync": 1, ...}."""
    launcher = tmp_path / f"count_{time.monotonic_ns()}.py"
    launcher.write_text(COUNTER.format())
    out = tmp_path / "counts"
    out.mkdir()
    command = [*LAUNCH, f"--nproc_per_node={nproc}", str(launcher), str(step_dir(step)), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [*command, *args], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT
    )
    check(result)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def test_data_parallel_step_makes_its_bucket_and_one_more_collective(tmp_path):
    """dp 2 (step 6, one 25 MiB bucket): two all-reduces a step on each rank, the bucket's on the
    dp group and the facts' on the world, none on the tensor-parallel group of one rank, and one
    host sync."""
    for rank in count(tmp_path, S6, [*RUN, "--dp_size", "2"], nproc=2):
        assert rank == {"all_reduce on group of 2": 1, "all_reduce on world": 1, "host sync": 1}


@pytest.mark.parametrize("step", [S9, S11])
def test_3d_step_makes_one_collective_over_the_world_and_none_on_a_group_of_one(tmp_path, step):
    """tp 2 x pp 2 (1F1B; step 9, and step 11 with ZeRO-1 and its cp axis): besides the
    technique's calls (tp's all-reduces, pp's sends, the gradient norm's sum over tp x pp), one
    all-reduce over the world (the facts), none on a group of one rank (dp, dp x cp: the buckets'
    collectives), and one host sync."""
    args = [*RUN, "--tp_size", "2", "--pp_size", "2", "--pp_engine", "1f1b"]
    for rank in count(tmp_path, step, args, nproc=4):
        assert rank["all_reduce on world"] == 1, rank
        assert rank["host sync"] == 1, rank
        assert not [what for what in rank if what.endswith("group of 1")], rank
