"""The run's bookkeeping, the same whatever the layout: the step's clock and record, where its
numbers go (the console, a JSON-lines file, Weights & Biases), the profiler, what every rank
agrees on after a step, SIGTERM and torchrun's restarts, and what a resume restores beyond the
checkpoint (the --max_tokens count, this run's learning rate schedule). `Run` asks its concerns,
each in a module of its own: what the run does with its numbers between steps (recipes.py: the
schedule, early stopping, fp16's loss scale, a step that is not finite) and which checkpoints
are written and kept (retention.py).

    run = Run(args, device, flops_per_token, pgm)
    for step in range(run.start_step + 1, run.max_steps + 1):
        run.begin(step, optimizer)
        with run.communication():             # --comm_stats: what the first step sends
            facts = ...                       # one training step, which ends with agree(...)
        run.end(facts, tokens)                # stops the run on a step it must not go on from
        if run.should_validate(): run.record["val_loss"] = evaluate(...)
        run.log_step()                        # the record to the log file, the step line
        if run.should_save(): run.save(save_checkpoint, ...)
        if run.should_stop(): break
    run.close()

The questions (`should_...`) only ask; what writes, prunes or talks to the other ranks is a
call that says so.
"""

import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import yaml

from checkpoint import latest_checkpoint
from comm_stats import CommStats
from recipes import EarlyStop, LossScale, NonFiniteGuard, lr_factor
from retention import Checkpoints
from utils import StopSignal, log, peak_flops, throughput


class MetricsLog:
    """Where a step's numbers go: the console, a JSON-lines file and Weights & Biases (rank 0)."""

    def __init__(self, args, append):
        self.file, self.wandb = None, None
        if dist.get_rank() != 0:
            return
        write_run_file(args)
        if args.log_file:
            Path(args.log_file).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(args.log_file, "a" if append else "w")
        if args.use_wandb:
            import wandb  # only needed with --use_wandb; WANDB_MODE=offline works without network

            flags = args.resolved_flags
            self.wandb = wandb.init(project="pico3d", name=args.run_name, config=flags)

    def write(self, record):
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.wandb:
            self.wandb.log(record, step=record["step"])

    def close(self):
        if self.file:
            self.file.close()
        if self.wandb:
            self.wandb.finish()


def write_run_file(args):
    """The run's flags, as the run file and the command line resolved them, as YAML: run.yaml in
    --save_dir and NAME.run.yaml beside --log_file NAME.jsonl. `--config` of it repeats the run."""
    paths = [Path(args.save_dir) / "run.yaml"] if args.save_dir else []
    if args.log_file:
        paths.append(Path(args.log_file).with_suffix(".run.yaml"))
    text = yaml.safe_dump(args.resolved_flags, sort_keys=False)
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def start_profiler(folder, device):
    """With --profile DIR: torch.profiler skips step 1 (first-call overheads), warms up on step 2,
    records steps 3 to 5 and writes one Chrome trace per rank into DIR (chrome://tracing,
    ui.perfetto.dev or TensorBoard open it), with every allocation and free in it
    (tools/trace_memory.py reads the most held at once). None without the flag."""
    if not folder:
        return None
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(
            folder, worker_name=f"rank{dist.get_rank()}"
        ),
        record_shapes=True,
        profile_memory=True,
    )
    profiler.start()
    return profiler


def find_checkpoint(args):
    """With --resume, save_dir's latest checkpoint; None to start from step 0."""
    path = latest_checkpoint(args.save_dir) if args.save_dir else None
    if not args.resume:
        if path:
            log(
                f"warning: {args.save_dir} holds {path.name}; without --resume this run starts over"
            )
        return None
    if path is None:
        log(f"--resume: no checkpoint in {args.save_dir} yet, starting from step 0")
    return path


class Facts(NamedTuple):
    """What every rank knows alike after a step's backward (`agree`)."""

    loss: float  # the step's loss, the mean over the batch
    grad_norm: float
    loss_finite: bool  # on every rank
    grad_norm_finite: bool
    stop: bool  # SIGTERM came to some rank: every rank stops after this step
    sums: torch.Tensor | None = None  # a step's own statistics, summed over the world on the device

    @property
    def finite(self):
        return self.loss_finite and self.grad_norm_finite


def agree(loss, grad_norm, counted=True, replicas=1, sums=None):
    """The step's facts in one collective and one host sync, before the update: every rank then
    decides alike (a step that is not finite on one rank is applied on none) and stops after the
    same step. `loss`: this rank's loss; the logged loss is its sum over the ranks that count it
    (a rank whose loss copies another's does not), divided by `replicas`, the ranks that each saw
    their own share of the batch. `grad_norm` is the whole model's, the same on every rank. On a
    GPU each `.item()` waits for the queue to drain, so the five facts travel as one tensor.
    `sums`: a technique's statistics of the step (a tensor), summed over the world in the same
    collective and left on the device (`Facts.sums`): the host reads them only when it logs."""
    facts = torch.stack(
        [
            loss.float() if counted else torch.zeros_like(loss, dtype=torch.float32),
            (~torch.isfinite(loss)).float(),  # counts of the ranks where it is not finite
            (~torch.isfinite(grad_norm)).float(),
            torch.tensor(float(StopSignal.received), device=loss.device),
        ]
    )
    if sums is not None:
        facts = torch.cat([facts, sums.float().view(-1)])
    if dist.get_world_size() > 1:  # a world of one has nothing to agree on
        dist.all_reduce(facts)
    facts, sums = facts[:4], None if sums is None else facts[4:].view_as(sums)
    facts = torch.cat([facts, grad_norm.float().view(1)])  # the norm is already the same everywhere
    loss_sum, bad_loss, bad_norm, stop, norm = facts.tolist()
    return Facts(loss_sum / replicas, norm, bad_loss == 0, bad_norm == 0, stop > 0, sums)


def one_node(environ):
    """Whether torchrun (its variables in `environ`) runs every rank of the job on this node."""
    several = int(environ.get("GROUP_WORLD_SIZE", "1")) > 1  # GROUP: one launcher per node
    return not several and environ.get("LOCAL_WORLD_SIZE") == environ.get("WORLD_SIZE")


def restart_store(environ, timeout):
    """The store of torchrun's rendezvous (env://), for init_process_group, each try's keys under
    a prefix of its own. torchrun --max_restarts N starts the workers again after a failure and by
    default shares its own store with them, which still holds the addresses that the dead try's
    ranks wrote there: a new rank could read one and wait for a peer that is gone. On one node
    every worker has the same restart count, so `try<count>/` keeps the tries apart; across nodes
    each launcher counts its own restarts, so there the store stays as it is."""
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    if one_node(environ):
        store = dist.PrefixStore(f"try{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    return store


def check_restarts(environ):
    """torchrun --max_restarts N restarts the workers after a failure. Across nodes, with the
    rendezvous store shared with the workers (its default), the new group cannot connect: say so
    at start."""
    restarts = int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    shared = environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1"
    if restarts > 0 and shared and not one_node(environ):
        log(
            f"warning: torchrun may restart these workers (--max_restarts {restarts}), but a "
            "restarted group of several nodes cannot reconnect unless torchrun runs with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment"
        )


class Run:
    """One run's bookkeeping on the grid `pgm`: the step's clock and record, and the concerns it
    asks (`guard`: non-finite steps; `checkpoints`: when to save and what to keep). The flags
    are read, never written: the last step, which a resume with --max_tokens may move, is
    `max_steps` here. `flops_per_token`: the training FLOPs one device spends per token of the
    step, for the throughput and MFU of the step line. `replicas`: how many ranks hold the same
    weights; the dp ranks unless the step says otherwise."""

    def __init__(self, args, device, flops_per_token, pgm, replicas=None):
        self.args, self.device, self.flops, self.pgm = args, device, flops_per_token, pgm
        self.peak = peak_flops(device, args.peak_tflops)
        self.start_step, self.step, self.max_steps, self.record = 0, 0, args.max_steps, {}
        self.stop_signal, self.stopped = StopSignal(), False  # SIGTERM: finish the step, save, exit
        self.metrics = self.profiler = self.comm = None
        self.guard, self.loss_scale = NonFiniteGuard(args), LossScale(args)
        self.early_stop = EarlyStop(args)
        self.checkpoints = Checkpoints(args, device, pgm.dp_size if replicas is None else replicas)

    def resumed(self, step, optimizer, scheduler, tokens):
        """After a checkpoint of `step` was loaded, with `tokens` trained by then."""
        self.start_step = step
        self.stop_at_max_tokens(tokens)
        if step >= self.max_steps:  # a finished run started again: it evaluates and samples
            log(f"step {step} is at or past the last step, {self.max_steps}: nothing left to train")
        self.follow_this_runs_schedule(optimizer, scheduler)

    def stop_at_max_tokens(self, tokens):
        """With --max_tokens, after a resume: the run stops when the tokens trained so far (in the
        saved run's batches, which may differ from this run's) and whole steps of this run's batch
        reach it."""
        args, step = self.args, self.start_step
        if args.max_tokens is None:
            return
        left = max(0, args.max_tokens - tokens) // args.tokens_per_step
        stop = min(args.max_steps_given, step + left)
        if stop != self.max_steps:
            log(
                f"--max_tokens {args.max_tokens}: {tokens:,} tokens trained by step {step}, then "
                f"{args.tokens_per_step:,} a step: the run stops after step {stop}"
            )
        self.max_steps = stop

    def follow_this_runs_schedule(self, optimizer, scheduler):
        """The checkpoint brings back the saved run's learning rate; from here the run follows
        this one's --learning_rate, --warmup_steps and last step (unchanged flags: the same
        rate, to the bit). Says so when the rate changes, as when a run is extended."""
        args, step = self.args, self.start_step
        groups, saved = optimizer.param_groups, optimizer.param_groups[0]["lr"]
        factor = lr_factor(args, self.max_steps)
        scheduler.lr_lambdas = [factor for _ in groups]
        # Each group's own rate: --muon_learning_rate for Muon's matrices (muon.py).
        rates = [args.muon_learning_rate if g.get("muon") else args.learning_rate for g in groups]
        scheduler.base_lrs = rates
        for group, base in zip(groups, rates, strict=True):
            group.update(initial_lr=base, lr=base * factor(step))
        rate = groups[0]["lr"]
        if rate != saved:
            log(
                f"the learning rate of step {step + 1} is {rate:.3e} with this run's "
                f"--learning_rate, --warmup_steps and --max_steps; the saved run's was {saved:.3e}"
            )

    def begin(self, step, optimizer):
        """Before the step: its clock starts; the log and the profiler open at the first one,
        when also the disk is checked to hold a checkpoint."""
        self.step, self.optimizer = step, optimizer
        if self.metrics is None:
            self.open()
            self.loss_scale.start(optimizer)
            if self.args.save_dir:  # refused here, before any work, rather than at the first save
                self.checkpoints.disk_holds_one(step, optimizer)
        self.lr, self.start = optimizer.param_groups[0]["lr"], time.perf_counter()

    @contextmanager
    def communication(self):
        """With --comm_stats, around the run's first step: every collective and send/receive it
        makes, by process group and kind, logged on every rank and written to the step's record."""
        if not (self.args.comm_stats and self.step == self.start_step + 1):
            yield
            return
        with CommStats(self.pgm) as stats:
            yield
        log(stats.table(), all_ranks=True)
        self.comm = stats.as_dict()

    def open(self):
        """The log and the profiler, opened once the start step is known (after a resume)."""
        self.metrics = MetricsLog(self.args, append=self.start_step > 0)
        self.profiler = start_profiler(self.args.profile, self.device)

    def end(self, facts, tokens):
        """After the step: what the ranks agreed on (its loss, gradient norm, whether they are
        finite, whether to stop) and the tokens trained so far (the rows served times seq_len:
        right after a resume that changed the batch, too). A step that must not go on stops the
        run here, before anything is validated or saved."""
        tokens_per_second = self.args.tokens_per_step / (time.perf_counter() - self.start)
        if self.profiler:
            self.profiler.step()
        self.record = {"step": self.step, "loss": facts.loss, "grad_norm": facts.grad_norm}
        self.record["lr"], self.stopped = self.lr, facts.stop
        self.record.update(tokens=tokens, tokens_per_second=tokens_per_second)
        if self.comm:
            self.record["comm"], self.comm = self.comm, None
        why = self.guard.check(facts, self.step, self.record)
        why = why or self.loss_scale.update(facts, self.optimizer, self.step, self.record)
        if why:
            self.metrics.write(self.record)
            raise ValueError(why)

    def last(self):
        return self.step == self.max_steps

    def should_validate(self):
        return (self.args.eval_every and self.step % self.args.eval_every == 0) or self.last()

    def log_step(self):
        """Writes the step's record; prints the validation loss, when the step has one, and every
        log_every steps the step line."""
        record = self.record
        self.metrics.write(record)
        if "val_loss" in record:
            log(f"step {self.step}/{self.max_steps} | validation loss {record['val_loss']:.4f}")
        self.early_stop.check(self.step, record.get("val_loss"))
        if self.should_log():
            flops_per_second = self.flops * record["tokens_per_second"]
            log(
                f"step {self.step}/{self.max_steps} | loss {record['loss']:.4f}"
                f" | lr {record['lr']:.2e} | grad_norm {record['grad_norm']:.3f}"
                f" | {record['tokens_per_second']:,.0f} tok/s"
                f" | {throughput(flops_per_second, self.peak)}"
            )

    def should_log(self):
        """Whether this step prints its step line: every log_every steps and at the last."""
        return self.step % self.args.log_every == 0 or self.last()

    def should_save(self):
        """Every save_every steps, at the last step, and when SIGTERM came to some rank (the
        step's facts)."""
        # An early stop keeps its last step, and its best one, saved when it came.
        last = self.last() or self.early_stop.stopped or self.early_stop.improved
        return self.checkpoints.due(self.step, last, self.stopped)

    def save(self, write, *args):
        """`write(*args)` writes the checkpoint if the disk holds it, after --keep_last prunes."""
        best = self.early_stop.improved
        self.checkpoints.save(self.step, self.optimizer, lambda: write(*args), best)

    def should_stop(self):
        return self.stopped or self.early_stop.stopped

    def close(self):
        """After the loop. A run shorter than the profiler's schedule writes what it recorded."""
        if self.stopped:
            step = self.step
            log(f"stopped by SIGTERM after step {step}; with --save_dir, --resume continues it")
        if self.metrics is None:  # no step was left to train
            self.open()
        self.metrics.close()
        self.checkpoints.close()
        if self.profiler:
            self.profiler.stop()
            log(f"profile: one trace per rank in {self.args.profile}")
