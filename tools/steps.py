"""Find the step folders of the course and the files that belong to each step.

A step folder sits at the repository root and is named `step<number>_<topic>`; the steps are
ordered by their number (step10 comes after step9). A file belongs to a step when git tracks it
or would track it: untracked files count as soon as they exist (so a new file is part of the step
before it is committed), ignored files never do, and neither does anything in `__pycache__` or
ending in `.pyc`, even if it was committed by mistake.
"""

import os
import re
import subprocess
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

STEP_NAME = re.compile(r"step(\d+)_[A-Za-z0-9_]+")


def git(root: Path, *args: str) -> bytes:
    """Run git in `root` and return its stdout; a failure raises with git's own message."""
    result = subprocess.run(["git", "-C", str(root), *args], capture_output=True)
    if result.returncode != 0:
        message = result.stderr.decode(errors="replace").strip()
        raise RuntimeError(f"`git {' '.join(args)}` failed in {root}: {message}")
    return result.stdout


def step_number(folder: Path) -> int:
    match = STEP_NAME.fullmatch(folder.name)
    assert match, f"{folder.name} is not a step folder"
    return int(match.group(1))


def step_folders(root: Path) -> list[Path]:
    """The step folders at the root, ordered by their number (as numbers: 9 before 10)."""
    folders = [p for p in root.iterdir() if p.is_dir() and STEP_NAME.fullmatch(p.name)]
    folders.sort(key=step_number)
    for earlier, later in pairwise(folders):
        if step_number(earlier) == step_number(later):
            raise ValueError(
                f"two folders for step {step_number(later)}: {earlier.name}, {later.name}"
            )
    return folders


def step_modules(root: Path) -> list[str]:
    """The names of the Python modules the step folders hold (model, train, ...). The steps share
    them: a process that imports two steps' modules drops these from its cache in between."""
    return sorted({p.stem for step in step_folders(root) for p in step.glob("*.py")})


def is_build_output(path: str) -> bool:
    return "__pycache__" in path.split("/") or path.endswith(".pyc")


def step_files(root: Path, step: Path) -> list[str]:
    """Files of one step, as sorted posix paths relative to the step folder."""
    # --cached: tracked files; --others --exclude-standard: untracked files git does not ignore.
    listing = ["ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    out = git(root, *listing, "--", step.name)
    prefix = step.name + "/"
    files = set()
    for name in os.fsdecode(out).split("\0"):
        if not name.startswith(prefix) or is_build_output(name):
            continue
        # A tracked file deleted from the working tree is no longer part of the step.
        if (root / name).is_file():
            files.add(name[len(prefix) :])
    return sorted(files)


# ---- The manifest: the course's steps in one table ---------------------------------------------


@dataclass(frozen=True)
class Blank:
    """A function of a step's exercise (tools/exercise.py): `name` in the step's file `file` (a
    function, or `Class.method`), whose body the learner writes; `hint` is what it says when
    called before it is written."""

    file: str
    name: str
    hint: str


@dataclass(frozen=True)
class Step:
    """One step of the course. `changes`: the files it adds or changes from the step before (every
    other file is that step's, byte for byte); `frozen`: those of them that no later step changes.
    What the tools run for it: `convergence`, its layouts trained against one device, each
    (name, processes, flags, the divisor of the baseline's gradient accumulation); `memory`, the
    layout of its row in tools/memory_table.py; `bench`, the parts of tools/bench.py that measure
    its technique against PyTorch's (its name: processes). Its exercise: `blanks`, the functions
    to write, in the order to write them; `graded`, the tests that grade them (pytest node ids),
    smallest first: each layer against its single-device reference, then the collectives
    counted, then the whole layout against one device."""

    folder: str
    changes: tuple[str, ...]
    frozen: tuple[str, ...] = ()
    convergence: tuple[tuple, ...] = ()
    memory: dict | None = None
    bench: dict = field(default_factory=dict)
    blanks: tuple[Blank, ...] = ()
    graded: tuple[str, ...] = ()

    @property
    def number(self):
        return int(STEP_NAME.fullmatch(self.folder).group(1))


DP2_BUCKETS = ("--dp_size", "2", "--bucket_size_mb", "0.05")  # several buckets for a tiny model
PP2 = ("--pp_size", "2", "--pp_engine")  # then the engine
GRID = ("--tp_size", "2", "--dp_size", "2", "--pp_size", "2", "--pp_engine", "1f1b")
ZERO3 = ("--zero_stage", "3")
# Step 4: f and g first, each with the layer that uses it; then the vocabulary's two layers, the
# gather of the logits, and the plan that puts them all in the model.
TP = "tensor_parallel.py"
TP_BLANKS = (
    Blank(TP, "Copy.forward", "f is the identity forward; keep the group in ctx for backward"),
    Blank(TP, "Copy.backward",
          "every rank's slice read the whole input: all-reduce the gradient over ctx.group"),
    Blank(TP, "ColumnParallelLinear.forward",
          "a local matmul with this rank's rows of the weight: its slice of the output features"),
    Blank(TP, "Reduce.forward", "g sums the ranks' partial results: an all-reduce over group"),
    Blank(TP, "Reduce.backward", "the gradient of a sum reaches every term whole: the identity"),
    Blank(TP, "RowParallelLinear.forward",
          "this rank's columns of the weight give a partial sum of the output; g adds them up"),
    Blank(TP, "VocabParallelEmbedding.forward",
          "look up the ids in [vocab_start, vocab_start + vocab_per_partition), zeros for the "
          "others, then g"),
    Blank(TP, "vocab_parallel_cross_entropy",
          "log(sum exp(z - m)) - (z_target - m): the max m, the sum and the target's logit "
          "reduced over group"),
    Blank(TP, "Gather.forward",
          "all-gather the ranks' slices, side by side along the last dim; keep the group in ctx"),
    Blank(TP, "Gather.backward", "keep this rank's slice of the gradient, along the last dim"),
    Blank(TP, "apply_tensor_parallel",
          "swap what PLAN names, embed_tokens and lm_head; f on every norm's output (a forward "
          "hook); tie_weights"),
)  # fmt: skip
TP_TESTS = "tests/test_tensor_parallel.py::"
TP_GRADED = (
    *(f"{TP_TESTS}test_layer_matches_dense[{layer}]"
      for layer in ("column", "row", "embedding", "cross_entropy", "gather")),
    f"{TP_TESTS}test_two_all_reduces_forward_and_two_backward_per_block[untied]",
    f"{TP_TESTS}test_model_matches_single_device[untied]",
    f"{TP_TESTS}test_tp2_trains_like_one_process",
)  # fmt: skip
STEPS = [
    Step("step1_model", ("model.py", "train.py", "utils.py", "README.md"), ("model.py",),
         bench={"model": 1}),
    Step("step2_process_group_manager",
         ("process_group_manager.py", "comm_stats.py", "train.py", "README.md"),
         ("comm_stats.py",)),
    Step("step3_dataloader",
         ("dataloader.py", "checkpoint.py", "utils.py", "flags.py", "bookkeeping.py", "train.py",
          "README.md"),
         ("utils.py", "flags.py", "bookkeeping.py"), memory={}),
    Step("step4_tensor_parallel",
         ("tensor_parallel.py", "placement.py", "checkpoint.py", "train.py", "README.md"),
         ("tensor_parallel.py", "placement.py"),
         convergence=(("tp2", 2, ("--tp_size", "2"), 1),), memory={"tp": 2}, bench={"tp": 2},
         blanks=TP_BLANKS, graded=TP_GRADED),
    Step("step5_data_parallel_naive",
         ("data_parallel.py", "dataloader.py", "train.py", "README.md"),
         convergence=(("dp2_naive", 2, ("--dp_size", "2"), 2),), memory={"dp": 2}),
    Step("step6_data_parallel_bucket",
         ("data_parallel.py", "overlap_timeline.py", "train.py", "README.md"),
         ("data_parallel.py", "overlap_timeline.py"),
         convergence=(("dp2_bucket", 2, DP2_BUCKETS, 2),), memory={"dp": 2}, bench={"dp": 2}),
    Step("step7_pipeline_parallel_afab",
         ("pipeline_parallel.py", "pipeline_timeline.py", "checkpoint.py", "train.py", "README.md"),
         ("pipeline_timeline.py",),
         convergence=(("pp2_afab", 2, (*PP2, "afab"), 1),),
         memory={"pp": 2, "micro_batches": 4}),
    Step("step8_pipeline_parallel_1f1b", ("pipeline_parallel.py", "train.py", "README.md"),
         convergence=(("pp2_1f1b", 2, (*PP2, "1f1b"), 1),),
         memory={"pp": 4, "engine": "1f1b", "micro_batches": 8}, bench={"pp": 2}),
    Step("step9_3d_parallel", ("checkpoint.py", "hf_import.py", "train.py", "README.md"),
         ("hf_import.py",),
         convergence=(("tp2_dp2_pp2", 8, (*GRID, "--bucket_size_mb", "0.05"), 2),
                      ("pp3_1f1b", 3, ("--pp_size", "3", "--pp_engine", "1f1b"), 1)),
         memory={"tp": 2, "pp": 2, "engine": "1f1b", "micro_batches": 4}),
    Step("step10_zero1", ("zero.py", "train.py", "checkpoint.py", "README.md"),
         convergence=(("zero1_dp2", 2, DP2_BUCKETS, 2),
                      ("zero1_tp2_dp2", 4, (*DP2_BUCKETS, "--tp_size", "2"), 2),
                      ("zero1_tp2_dp2_pp2", 8,
                       (*DP2_BUCKETS, "--tp_size", "2", "--pp_size", "2", "--pp_engine", "1f1b"),
                       2)),
         memory={"tp": 2, "dp": 2}, bench={"zero": 2}),
    Step("step11_context_parallel",
         ("context_parallel.py", "process_group_manager.py", "dataloader.py",
          "pipeline_parallel.py", "checkpoint.py", "train.py", "README.md"),
         convergence=(("cp2", 2, ("--cp_size", "2"), 1),
                      ("cp2_tp2", 4, ("--cp_size", "2", "--tp_size", "2"), 1),
                      ("pp2_cp2", 4, ("--cp_size", "2", *PP2, "1f1b"), 1),
                      ("dp2_pp2_cp2", 8,
                       ("--cp_size", "2", *PP2, "1f1b", "--dp_size", "2", "--bucket_size_mb",
                        "0.05"), 2)),
         memory={"cp": 2}, bench={"cp": 2}),
    Step("step12_zero3", ("fully_sharded.py", "zero.py", "train.py", "README.md"),
         ("fully_sharded.py", "zero.py"),
         convergence=(("zero2_dp2", 2, (*DP2_BUCKETS, "--zero_stage", "2"), 2),
                      ("zero3_tp2_dp2", 4, ("--dp_size", "2", "--tp_size", "2", *ZERO3), 2),
                      ("zero3_dp2_pp2", 4, ("--dp_size", "2", *PP2, "1f1b", *ZERO3), 2),
                      ("zero3_dp2_cp2", 4, ("--dp_size", "2", "--cp_size", "2", *ZERO3), 2))),
]  # fmt: skip


def step_entry(number):
    """The manifest's entry of step `number`."""
    [entry] = [step for step in STEPS if step.number == number]
    return entry
