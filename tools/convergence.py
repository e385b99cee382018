"""Convergence harness: every parallel layout must train like step 3 on one process.

Runs the single-process baseline (step 3) and a list of parallel layouts on the same data, seed
and so initial weights, with the same global batch: a layout with dp_size replicas takes
1/dp_size of the baseline's accumulation. Then compares each optimizer step's loss and grad_norm
(and val_loss where both runs evaluated) with the baseline's. Parallelism only reorders
floating-point sums, so in fp32 the curves agree to about 1e-6 for the first tens of steps
(later the rounding differences grow: see `compare`); a real bug (gradients summed instead of
averaged, a shard read from the wrong place, a loss not divided by the number of micro-batches)
shows from the first step.

    python tools/convergence.py --steps 60 --out_dir runs/convergence
    python tools/convergence.py --layouts tp2,pp2_1f1b -- --dataset_name roneneldan/TinyStories
    python tools/convergence.py --layouts pp3_1f1b --reshard   # also: stop halfway, go on in
                                                               # another layout (step 9)
    python tools/convergence.py --tied --num_hidden_layers 5 --steps 10   # tied embeddings
    python tools/convergence.py --zero1              # the sharded optimizer (step 10), in 3D too
    python tools/convergence.py --cp                 # context parallelism (step 11), in 4D too
    python tools/convergence.py --moe --gradient_accumulation_steps 4 --steps 20   # step 15

`inject(bug)` (the CLI's `--bug NAME`) writes a launcher that runs a step's train.py with one
known bug patched in from outside, the step's files untouched, to show that the comparison
catches it.
"""

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from steps import step_entry

ROOT = Path(__file__).resolve().parents[1]
STEP9 = "step9_3d_parallel"
STEP10 = "step10_zero1"
STEP11 = "step11_context_parallel"
STEP15 = "step15_expert_parallel"
OVERRIDES = [
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
]


@dataclass(frozen=True)
class Layout:
    """One way to run training: a step folder on `nproc` processes, with its parallel flags and
    its own gradient accumulation."""

    name: str
    step: str
    nproc: int
    flags: tuple[str, ...] = ()
    accumulation: int = 1


def baseline_layout(accumulation):
    return Layout("baseline", "step3_dataloader", 1, (), accumulation)


def step_layouts(number, accumulation):
    """Step `number`'s layouts (tools/steps.py's manifest), each on its share of a baseline that
    accumulates `accumulation` micro-batches: a layout with dp_size 2 takes half."""
    layouts = []
    for name, nproc, flags, divisor in step_entry(number).convergence:
        if accumulation % divisor:
            raise ValueError(
                f"accumulation={accumulation}: the layout {name} takes accumulation / {divisor} "
                f"(its dp_size), which must be whole; use a multiple of {divisor}"
            )
        layouts.append(
            Layout(name, step_entry(number).folder, nproc, flags, accumulation // divisor)
        )
    return layouts


def default_layouts(accumulation):
    """The layouts of steps 4 to 9 compared with a baseline that accumulates `accumulation`
    micro-batches. With a 3-layer model pp2 is uneven (2 + 1 layers), and pp3 runs fewer
    micro-batches than stages when accumulation < 3."""
    return [layout for number in range(4, 10) for layout in step_layouts(number, accumulation)]


@dataclass(frozen=True)
class Reshard:
    """A step-9 run that saves halfway in one layout and goes on from that checkpoint in
    another."""

    name: str
    first: Layout
    second: Layout


def reshard_layouts(accumulation):
    """Saved at pp 3 (one layer per stage), resumed at tp 2 x dp 2: every axis changes."""
    pp3 = Layout("pp3", STEP9, 3, ("--pp_size", "3", "--pp_engine", "1f1b"), accumulation)
    tp2_dp2 = Layout("tp2_dp2", STEP9, 4, ("--tp_size", "2", "--dp_size", "2"), accumulation // 2)
    return [Reshard("pp3->tp2_dp2", pp3, tp2_dp2)]


def run_resharded(reshard, common_args, out_dir, steps, env=None, timeout=600):
    """Train `reshard.first` for `steps`, saving at steps // 2, then resume that checkpoint in
    `reshard.second` up to `steps` (the first run goes to the end, so that both halves follow
    the same learning-rate schedule). Returns the first half's log followed by the second's."""
    out_dir, half = Path(out_dir) / reshard.name.replace(">", ""), steps // 2
    save = ["--save_dir", str(out_dir / "checkpoints")]
    first = replace(reshard.first, name="first")
    records = run(
        first, [*common_args, *save, "--save_every", str(half)], out_dir, env, None, timeout
    )
    (out_dir / "checkpoints" / "latest").write_text(f"step_{half:06d}")  # as if it stopped there
    second = replace(reshard.second, name="second")
    return records[:half] + run(
        second, [*common_args, *save, "--resume"], out_dir, env, None, timeout
    )


def tied_layouts(accumulation):
    """Layouts of a model with tied embeddings (see `tied_config`), whose embedding and lm_head
    live on different stages: pp2 (step 7, AFAB), pp3 (step 8, 1F1B), tp2 x pp2 (step 8, AFAB)
    and the 3D grid (step 9, 1F1B). With 5 layers both pp2 and pp3 are uneven."""
    if accumulation % 2:
        raise ValueError(
            f"accumulation={accumulation} is odd: the dp_size=2 layouts take accumulation / 2"
        )
    half = accumulation // 2
    tp2_pp2 = ("--tp_size", "2", "--pp_size", "2", "--pp_engine", "afab")
    grid = ("--tp_size", "2", "--dp_size", "2", "--pp_size", "2", "--pp_engine", "1f1b")
    pp3 = ("--pp_size", "3", "--pp_engine", "1f1b")
    return [
        Layout(
            "tied_pp2_afab", "step7_pipeline_parallel_afab", 2, ("--pp_size", "2"), accumulation
        ),
        Layout("tied_pp3_1f1b", "step8_pipeline_parallel_1f1b", 3, pp3, accumulation),
        Layout("tied_tp2_pp2_afab", "step8_pipeline_parallel_1f1b", 4, tp2_pp2, accumulation),
        Layout("tied_tp2_dp2_pp2", STEP9, 8, (*grid, "--bucket_size_mb", "0.05"), half),
    ]


def zero1_layouts(accumulation):
    """Step 10's layouts: the optimizer state sharded over 2 dp ranks, alone, with tp 2, and in
    3D (small buckets, so that shards cut parameters)."""
    return step_layouts(10, accumulation)


def moe_layouts(accumulation):
    """Step 15's layouts: the mixture of experts (tiny-moe) with its experts split over 2 ranks,
    and with every other axis; against the same MoE on one process, `moe_baseline`."""
    return step_layouts(15, accumulation)


def moe_baseline(accumulation):
    return Layout("baseline", STEP15, 1, ("--model_name", "tiny-moe"), accumulation)


def cp_layouts(accumulation):
    """Step 11's layouts: each sequence split over 2 cp ranks, alone, with tp 2, with pp 2, and
    in 4D (dp 2 x pp 2 x cp 2 x tp 1, 8 processes). seq_len must divide by 4."""
    return step_layouts(11, accumulation)


def tied_config(model_name, directory):
    """Write `model_name`'s config (assets/configs/NAME, a folder or a hub id) with
    tie_word_embeddings=True into `directory`; returns the folder, for --model_name."""
    from transformers import AutoConfig  # only here: the rest of the harness needs no torch

    local = ROOT / "assets" / "configs" / model_name
    config = AutoConfig.from_pretrained(str(local) if local.is_dir() else model_name)
    config.tie_word_embeddings = True
    config.save_pretrained(directory)
    return Path(directory)


# How a layout's processes start (the tests start them with tests/launch.py, which forks them).
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def run(layout, common_args, out_dir, env=None, launcher=None, timeout=600):
    """Train `layout` with `common_args` under torchrun; returns its log, one dict per step. A
    `launcher` (from `inject`) runs in place of the step's train.py. The console output goes to
    out_dir/NAME.log, the JSON lines to out_dir/NAME.jsonl."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_file, console = out_dir / f"{layout.name}.jsonl", out_dir / f"{layout.name}.log"
    log_file.unlink(missing_ok=True)
    step = ROOT / layout.step
    script = [str(launcher), str(step)] if launcher else [str(step / "train.py")]
    command = [*TORCHRUN, f"--nproc_per_node={layout.nproc}", *script, *common_args]
    command += [*layout.flags, "--gradient_accumulation_steps", str(layout.accumulation)]
    command += ["--log_file", str(log_file)]
    # One thread per process unless the caller says otherwise: the ranks share the cores.
    full_env = {"OMP_NUM_THREADS": "1", **os.environ, **(env or {})}
    # A session of its own, so that a timeout kills torchrun and its workers together.
    process = subprocess.Popen(
        command,  # in the caller's folder: relative paths (out_dir, a model folder) mean the same
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
    console.write_text(stdout + stderr)
    if process.returncode != 0:
        # The first line says why: the timeout, or the last exception a rank raised.
        errors = [line for line in stderr.splitlines() if "Error: " in line]
        errors = [line.split("]: ", 1)[-1] for line in errors if "ChildFailedError" not in line]
        why = f"took over {timeout} s" if process.returncode < 0 else "; ".join(errors[-1:])
        raise RuntimeError(
            f"{layout.name} failed (exit {process.returncode}): {why}\n"
            f"{' '.join(command)}\n{stderr[-3000:]}\nfull output in {console}"
        )
    return [json.loads(line) for line in log_file.read_text().splitlines()]


@dataclass
class Comparison:
    """A run against the baseline: per step, the absolute and relative differences; their
    maxima; the last step up to which every step was within the strict tolerances; `problems`,
    the first failure of each kind (none: `ok`)."""

    steps: list[dict] = field(default_factory=list)
    max_loss: float = 0.0  # max |loss - baseline|
    max_rel_grad: float = 0.0  # max |grad_norm - baseline| / baseline
    max_val_loss: float | None = None  # max |val_loss - baseline|, None if never both evaluated
    exact_through: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self):
        return not self.problems


def show(record, key):
    value = record.get(key)
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def difference(got, want):
    d = abs(got - want)
    return math.inf if math.isnan(d) else d  # a NaN is never close


def compare(
    records,
    baseline,
    rtol_loss=1e-5,
    rtol_grad=1e-4,
    atol_loss=1e-6,
    exact_steps=None,
    rtol_late=1e-2,
):
    """Compare a run's log with the baseline's, step by step: the loss (and val_loss) within
    max(rtol_loss * |baseline|, atol_loss), the grad norm within rtol_grad * baseline, the same
    tokens. Rounding differences grow chaotically over a long run (on the tiny model, from 1e-6
    to about 1e-3 within tens of steps); so with `exact_steps`, the later steps are only held to
    rtol_late on the loss and val_loss, the grad norm of a perturbed trajectory being too jumpy
    to compare step by step."""
    result = Comparison()
    got_steps, want_steps = [r["step"] for r in records], [r["step"] for r in baseline]
    if got_steps != want_steps:
        result.problems.append(f"{len(got_steps)} steps logged, the baseline {len(want_steps)}")
    failed, diverged = set(), False
    for got, want in zip(records, baseline, strict=False):  # a short run: as far as it went
        step = want["step"]
        row = {"step": step, "d_loss": difference(got["loss"], want["loss"])}
        row["rel_loss"] = row["d_loss"] / abs(want["loss"])
        row["d_grad_norm"] = difference(got["grad_norm"], want["grad_norm"])
        row["rel_grad_norm"] = row["d_grad_norm"] / abs(want["grad_norm"])
        if "val_loss" in got and "val_loss" in want:
            row["d_val_loss"] = difference(got["val_loss"], want["val_loss"])
        result.steps.append(row)

        def within(rtol, kind, row=row, want=want):
            return row[f"d_{kind}"] <= max(rtol * abs(want[kind]), atol_loss)

        strict = {
            "loss": within(rtol_loss, "loss"),
            "grad_norm": row["rel_grad_norm"] <= rtol_grad,
            "tokens": got.get("tokens") == want.get("tokens"),  # the same global batch
        }
        if "d_val_loss" in row:
            strict["val_loss"] = within(rtol_loss, "val_loss")
        diverged = diverged or not all(strict.values())
        result.exact_through = result.exact_through if diverged else step
        held = strict
        if exact_steps is not None and step > exact_steps:  # later: the loss curves, loosely
            held = {
                kind: within(rtol_late, kind) for kind in ["loss", "val_loss"] if kind in strict
            }
            held["tokens"] = strict["tokens"]
        for kind, ok in held.items():
            if not ok and kind not in failed:
                failed.add(kind)
                result.problems.append(
                    f"{kind} at step {step}: {show(got, kind)} vs {show(want, kind)}"
                )
    if result.steps:
        result.max_loss = max(row["d_loss"] for row in result.steps)
        result.max_rel_grad = max(row["rel_grad_norm"] for row in result.steps)
        val = [row["d_val_loss"] for row in result.steps if "d_val_loss" in row]
        result.max_val_loss = max(val) if val else None
    return result


def table(results):
    """A markdown table of {layout name: Comparison}."""
    header = ["layout", "steps", "max \\|Δloss\\|", "max rel Δgrad_norm", "max \\|Δval_loss\\|"]
    lines = [f"| {' | '.join(header)} | verdict |", "| --- | ---: | ---: | ---: | ---: | --- |"]
    for name, c in results.items():
        val = "—" if c.max_val_loss is None else f"{c.max_val_loss:.1e}"
        verdict = "ok" if c.ok else "DIFFERS: " + "; ".join(c.problems)
        if 0 < c.exact_through < c.steps[-1]["step"]:  # it drifted later on
            verdict += f" (exact through step {c.exact_through})"
        lines.append(
            f"| {name} | {len(c.steps)} | {c.max_loss:.1e} | {c.max_rel_grad:.1e} | {val} | "
            f"{verdict} |"
        )
    return "\n".join(lines) + "\n"


# Bug injection: each bug is the layout it breaks and a patch applied to the step's modules
# before train.main() runs. One launcher serves every step: torchrun runs `launch.py STEP [flags]`.
LAUNCHER = '''"""Generated by tools/convergence.py: a step's train.py with the bug {bug!r}."""
import sys
from pathlib import Path

step = Path(sys.argv[1]).resolve()
sys.path.insert(0, str(step))  # the step's modules: train, data_parallel, dataloader, ...
sys.argv = [str(step / "train.py"), *sys.argv[2:]]
'''
BUGS = {
    "dp_not_averaged": (
        "dp2_bucket",
        """
import torch.distributed as dist
import data_parallel

def sync_gradient(self):
    assert self.handle is None
    # The bug: no `self.grad_data /= self.dp_size`, the replicas' gradients are summed.
    self.handle = dist.all_reduce(self.grad_data, group=self.dp_group, async_op=True)

data_parallel.Bucket.sync_gradient = sync_gradient
""",
    ),
    "pp_loss_not_divided": (
        "pp2_1f1b",
        """
import argparse
import train

parser = argparse.ArgumentParser(add_help=False)
parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
m = parser.parse_known_args()[0].gradient_accumulation_steps
correct_loss_fn = train.loss_fn
# The bug: the schedules divide each micro-batch's loss by m; multiplying undoes it.
train.loss_fn = lambda *args: correct_loss_fn(*args) * m
""",
    ),
    "shard_offset": (
        "dp2_bucket",
        """
import dataloader

correct_init = dataloader.MicroBatchDataLoader.__init__

def __init__(self, *args, **kwargs):
    correct_init(self, *args, **kwargs)
    if self.shuffle:  # the bug: the training loader starts one micro-batch per rank late
        self.position = self.micro_batch_size * self.dp_size

dataloader.MicroBatchDataLoader.__init__ = __init__
""",
    ),
    "tp_weights_differ": (
        "tp2",
        """
import tensor_parallel

def init_parameter(self, name, make_full):
    full = make_full((self.out_features, self.in_features))
    return full.chunk(self.tp_size, dim=0)[0]  # the bug: rank 0's rows on every rank

tensor_parallel.ColumnParallelLinear.init_parameter = init_parameter
""",
    ),
    "tied_grad_not_summed": (
        "tied_pp2_afab",
        """
import pipeline_parallel

# The bug: no sum over the first and last stage, each copy of the tied embedding follows its own
# gradient (the embedding's on the first stage, lm_head's on the last).
pipeline_parallel.TiedEmbeddings.sum_gradients = lambda self: None
""",
    ),
}


def inject(bug, directory=None):
    """Write a launcher that runs a step's train.py with `bug` patched in (None: no patch, the
    control) into `directory` (a new temporary folder by default); returns its path."""
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r}; known: {', '.join(BUGS)}")
    directory = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="pico3d-bug-"))
    path = directory / f"launch_{bug or 'no_bug'}.py"
    patch = BUGS[bug][1] if bug else ""
    path.write_text(LAUNCHER.format(bug=bug) + patch + "\nimport train\n\ntrain.main()\n")
    return path


def plot(baseline, runs, path):
    """Loss against step for the baseline and every layout, and |loss - baseline| on a log scale.
    Returns False, writing nothing, when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, (curves, gaps) = plt.subplots(2, 1, figsize=(9, 8), sharex=True)
    steps = [r["step"] for r in baseline]
    curves.plot(steps, [r["loss"] for r in baseline], "k", lw=4, alpha=0.3, label="baseline")
    want = {r["step"]: r["loss"] for r in baseline}
    for name, records in runs.items():
        mine = [r for r in records if r["step"] in want]
        curves.plot([r["step"] for r in mine], [r["loss"] for r in mine], lw=1, label=name)
        gap = [abs(r["loss"] - want[r["step"]]) for r in mine]
        # An exact zero has no place on a log scale: it is left out of the line.
        gaps.plot([r["step"] for r in mine], [g if g > 0 else math.nan for g in gap], ".-", lw=1)
    curves.set(ylabel="training loss", title="every layout against step 3 on one process")
    curves.legend()
    gaps.set(xlabel="step", ylabel="|loss - baseline| (zeros not drawn)", yscale="log")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def parse_args(argv):
    # Everything after `--` goes unchanged to every run's train.py.
    passthrough = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    names = [layout.name for layout in default_layouts(2)]
    tied_names = [layout.name for layout in tied_layouts(2)]
    cp_names = [layout.name for layout in cp_layouts(2)]
    zero1_names = [layout.name for layout in zero1_layouts(2)]
    moe_names = [layout.name for layout in moe_layouts(4)]
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="flags after -- go to every train.py: -- --dataset_name roneneldan/TinyStories",
    )
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per run")
    parser.add_argument("--out_dir", default="runs/convergence")
    parser.add_argument(
        "--layouts",
        help=f"comma-separated, default all: {','.join(names)} (with --tied: "
        f"{','.join(tied_names)}; with --cp: {','.join(cp_names)}; with --zero1: "
        f"{','.join(zero1_names)}; with --moe: {','.join(moe_names)})",
    )
    parser.add_argument(
        "--bug",
        choices=sorted(BUGS),
        help="run only the layout this bug breaks, with the bug patched in: it must differ",
    )
    parser.add_argument(
        "--gradient_accumulation_steps", type=int, default=2, help="the baseline's; even"
    )
    parser.add_argument("--model_name", default="tiny")
    parser.add_argument(
        "--tied",
        action="store_true",
        help="tie the model's embeddings (a config written to out_dir/config_tied) and run the "
        "tied layouts instead",
    )
    parser.add_argument(
        "--cp", action="store_true", help="run step 11's context-parallel layouts instead"
    )
    parser.add_argument(
        "--zero1", action="store_true", help="run step 10's sharded-optimizer layouts instead"
    )
    parser.add_argument(
        "--moe",
        action="store_true",
        help="run step 15's expert-parallel layouts instead, against the same mixture of "
        "experts on one process (--gradient_accumulation_steps a multiple of 4)",
    )
    for name in OVERRIDES:
        parser.add_argument(f"--{name}", type=int)
    parser.add_argument("--micro_batch_size", type=int)
    parser.add_argument("--seq_len", type=int)
    parser.add_argument("--rtol_loss", type=float, default=1e-5, help="fp32; far more for bf16")
    # Looser than the test's 1e-4: at the tiny model's full shapes (256 tokens by 16 rows)
    # the grad norms of tp2 and step 3 differ by up to 1.3e-4 within ten steps.
    parser.add_argument("--rtol_grad", type=float, default=1e-3)
    parser.add_argument(
        "--exact_steps", type=int, default=10, help="steps held to rtol_loss and rtol_grad"
    )
    parser.add_argument(
        "--rtol_late", type=float, default=1e-2, help="the later steps' loss and val_loss"
    )
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    parser.add_argument(
        "--reshard",
        action="store_true",
        help=f"also {', '.join(r.name for r in reshard_layouts(2))}: half the steps in one "
        f"layout, the rest in another from its checkpoint",
    )
    args = parser.parse_args(argv)
    if args.tied + args.cp + args.zero1 + args.moe > 1:
        parser.error("--tied, --cp, --zero1 and --moe pick different layouts: give one of them")
    for flag in ["cp", "zero1", "moe"]:
        if args.bug and getattr(args, flag):
            parser.error(
                f"--bug {args.bug} breaks {BUGS[args.bug][0]}, not a --{flag} layout: no --{flag}"
            )
    kind = tied_layouts if args.tied else cp_layouts if args.cp else default_layouts
    kind = zero1_layouts if args.zero1 else moe_layouts if args.moe else kind
    try:
        layouts = kind(args.gradient_accumulation_steps)
    except ValueError as error:
        parser.error(str(error))
    names = tied_names if args.tied else cp_names if args.cp else names
    names = zero1_names if args.zero1 else moe_names if args.moe else names
    if args.layouts:
        wanted = args.layouts.split(",")
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            parser.error(f"unknown layouts {','.join(unknown)}; known: {','.join(names)}")
        layouts = [layout for layout in layouts if layout.name in wanted]
    if args.bug:
        if args.layouts:
            parser.error(
                f"--bug {args.bug} runs the layout it breaks, {BUGS[args.bug][0]}: no --layouts"
            )
        layouts = [layout for layout in layouts if layout.name == BUGS[args.bug][0]]
        if not layouts:
            parser.error(f"--bug {args.bug} breaks {BUGS[args.bug][0]}, a tied layout: add --tied")
    model_name = args.model_name
    if args.tied:
        try:
            model_name = str(tied_config(model_name, Path(args.out_dir) / "config_tied"))
        except OSError as error:
            parser.error(f"--model_name {args.model_name}: no config found ({error})")
    common = ["--max_steps", str(args.steps), "--model_name", model_name]
    for name in [*OVERRIDES, "micro_batch_size", "seq_len"]:
        if getattr(args, name) is not None:
            common += [f"--{name}", str(getattr(args, name))]
    return args, layouts, [*common, *passthrough]


def main(argv=None):
    args, layouts, common = parse_args(sys.argv[1:] if argv is None else argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    launcher = inject(args.bug, out_dir) if args.bug else None  # the baseline runs without it
    runs, results, failures = {}, {}, {}
    first = moe_baseline if args.moe else baseline_layout  # the same model on one process
    for layout in [first(args.gradient_accumulation_steps), *layouts]:
        start = time.perf_counter()
        bug = launcher if layout.name != "baseline" else None
        note = f" with the bug {args.bug}" if bug else ""
        print(f"{layout.name}: {layout.step} on {layout.nproc}{note} ...", end=" ", flush=True)
        try:
            runs[layout.name] = run(layout, common, out_dir, launcher=bug, timeout=args.timeout)
        except RuntimeError as error:
            if layout.name == "baseline":
                sys.exit(f"convergence.py: the baseline failed: {error}")
            failures[layout.name] = str(error).splitlines()[0]
            print("failed")
            continue
        print(f"{time.perf_counter() - start:.0f} s")
    for reshard in reshard_layouts(args.gradient_accumulation_steps) if args.reshard else []:
        print(f"{reshard.name}: {reshard.first.nproc}, then {reshard.second.nproc} ...", flush=True)
        try:
            runs[reshard.name] = run_resharded(
                reshard, common, out_dir, args.steps, None, args.timeout
            )
        except RuntimeError as error:
            failures[reshard.name] = str(error).splitlines()[0]
    baseline = runs.pop("baseline")
    for name, records in runs.items():
        results[name] = compare(
            records,
            baseline,
            args.rtol_loss,
            args.rtol_grad,
            exact_steps=args.exact_steps,
            rtol_late=args.rtol_late,
        )
    text = table(results) + "".join(f"\n{why}\n" for why in failures.values())
    (out_dir / "table.md").write_text(text)
    saved = {"baseline": baseline, "common_args": common, "layouts": {}}
    for layout in layouts:
        if layout.name in results:
            comparison = {**asdict(results[layout.name]), "ok": results[layout.name].ok}
            saved["layouts"][layout.name] = {
                "layout": asdict(layout),
                "comparison": comparison,
                "records": runs[layout.name],
            }
    (out_dir / "results.json").write_text(json.dumps(saved, indent=1) + "\n")
    print(text)
    if plot(baseline, runs, out_dir / "loss_curves.png"):
        print(f"wrote {out_dir}/table.md, results.json and loss_curves.png")
    else:
        print(f"wrote {out_dir}/table.md and results.json; no loss_curves.png without matplotlib")
        print('(pip install -e ".[plot]" installs it)')
    sys.exit(0 if not failures and all(c.ok for c in results.values()) else 1)


if __name__ == "__main__":
    main()
