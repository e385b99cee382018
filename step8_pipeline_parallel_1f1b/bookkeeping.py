"""The run's bookkeeping, the same whatever the layout: where a step's numbers go (the console, a
JSON-lines file, Weights & Biases), the profiler, when to validate and save, SIGTERM, and what a
resume restores beyond the checkpoint (the --max_tokens count, this run's learning rate
schedule).

    run = Run(args, device, flops_per_token)
    for step in range(run.start_step + 1, args.max_steps + 1):
        run.begin(step, optimizer)
        with run.communication(pgm):          # --comm_stats: what the first step sends
            ...                               # one training step
        run.end(loss, grad_norm, tokens)
        if run.should_validate(): run.record["val_loss"] = evaluate(...)
        run.log_step()
        if run.should_save(): save_checkpoint(...)
        if run.should_stop(): break
    run.close()
"""

import json
import math
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from checkpoint import latest_checkpoint
from comm_stats import CommStats
from utils import StopSignal, log, peak_flops, throughput


class MetricsLog:
    """Where a step's numbers go: the console, a JSON-lines file and Weights & Biases (rank 0)."""

    def __init__(self, args, append):
        self.file, self.wandb = None, None
        if dist.get_rank() != 0:
            return
        if args.log_file:
            Path(args.log_file).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(args.log_file, "a" if append else "w")
        if args.use_wandb:
            import wandb  # only needed with --use_wandb; WANDB_MODE=offline works without network

            self.wandb = wandb.init(project="pico3d", name=args.run_name, config=vars(args))

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


def start_profiler(folder, device):
    """With --profile DIR: torch.profiler skips step 1 (first-call overheads), warms up on step 2,
    records steps 3 to 5 and writes one Chrome trace per rank into DIR (chrome://tracing,
    ui.perfetto.dev or TensorBoard open it). None without the flag."""
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


def warmup_cosine(optimizer, args):
    """The learning rate: linear warm-up over --warmup_steps, then cosine decay to 10 % of
    --learning_rate at --max_steps (read at every step: a resume may move it)."""

    def lr_factor(step):
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


class Run:
    """One run's bookkeeping. `flops_per_token`: the training FLOPs one device spends per token of
    the step, for the throughput and MFU of the step line."""

    def __init__(self, args, device, flops_per_token):
        self.args, self.device, self.flops = args, device, flops_per_token
        self.peak = peak_flops(device, args.peak_tflops)
        self.start_step, self.step, self.record = 0, 0, {}
        self.stop_signal, self.stopped = StopSignal(), False  # SIGTERM: finish the step, save, exit
        self.metrics = self.profiler = self.comm = None

    def resumed(self, step, optimizer, scheduler, tokens):
        """After a checkpoint of `step` was loaded, with `tokens` trained by then."""
        self.start_step = step
        self.stop_at_max_tokens(tokens)
        if step >= self.args.max_steps:  # a finished run started again: it evaluates and samples
            last = self.args.max_steps
            log(f"step {step} is at or past the last step, {last}: nothing left to train")
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
        if stop != args.max_steps:
            log(
                f"--max_tokens {args.max_tokens}: {tokens:,} tokens trained by step {step}, then "
                f"{args.tokens_per_step:,} a step: the run stops after step {stop}"
            )
        args.max_steps = stop

    def follow_this_runs_schedule(self, optimizer, scheduler):
        """The checkpoint brings back the saved run's learning rate; from here the run follows
        this one's --learning_rate, --warmup_steps and --max_steps (unchanged flags: the same
        rate, to the bit). Says so when the rate changes, as when a run is extended."""
        args, step = self.args, self.start_step
        saved = optimizer.param_groups[0]["lr"]
        rate = args.learning_rate * scheduler.lr_lambdas[0](step)
        scheduler.base_lrs = [args.learning_rate for _ in optimizer.param_groups]
        for group in optimizer.param_groups:
            group.update(initial_lr=args.learning_rate, lr=rate)
        if rate != saved:
            log(
                f"the learning rate of step {step + 1} is {rate:.3e} with this run's "
                f"--learning_rate, --warmup_steps and --max_steps; the saved run's was {saved:.3e}"
            )

    def begin(self, step, optimizer):
        """Before the step: its clock starts; the log and the profiler open at the first one."""
        if self.metrics is None:
            self.open()
        self.step, self.lr, self.start = step, optimizer.param_groups[0]["lr"], time.perf_counter()

    @contextmanager
    def communication(self, pgm):
        """With --comm_stats, around the run's first step: every collective and send/receive it
        makes, by process group and kind, logged on every rank and written to the step's record."""
        if not (self.args.comm_stats and self.step == self.start_step + 1):
            yield
            return
        with CommStats(pgm) as stats:
            yield
        log(stats.table(), all_ranks=True)
        self.comm = stats.as_dict()

    def open(self):
        """The log and the profiler, opened once the start step is known (after a resume)."""
        self.metrics = MetricsLog(self.args, append=self.start_step > 0)
        self.profiler = start_profiler(self.args.profile, self.device)

    def end(self, loss, grad_norm, tokens):
        """After the step: its loss, gradient norm and the tokens trained so far (the rows served
        times seq_len: right after a resume that changed the batch, too)."""
        tokens_per_second = self.args.tokens_per_step / (time.perf_counter() - self.start)
        if self.profiler:
            self.profiler.step()
        self.record = {"step": self.step, "loss": loss, "grad_norm": grad_norm, "lr": self.lr}
        self.record.update(tokens=tokens, tokens_per_second=tokens_per_second)
        if self.comm:
            self.record["comm"], self.comm = self.comm, None

    def last(self):
        return self.step == self.args.max_steps

    def should_validate(self):
        return (self.args.eval_every and self.step % self.args.eval_every == 0) or self.last()

    def log_step(self):
        """The validation loss, when the step has one, and every log_every steps the step line."""
        args, record = self.args, self.record
        if "val_loss" in record:
            log(f"step {self.step}/{args.max_steps} | validation loss {record['val_loss']:.4f}")
        if self.step % args.log_every == 0 or self.last():
            flops_per_second = self.flops * record["tokens_per_second"]
            log(
                f"step {self.step}/{args.max_steps} | loss {record['loss']:.4f}"
                f" | lr {record['lr']:.2e} | grad_norm {record['grad_norm']:.3f}"
                f" | {record['tokens_per_second']:,.0f} tok/s"
                f" | {throughput(flops_per_second, self.peak)}"
            )

    def should_save(self):
        """Writes the step's record, then asks every rank whether SIGTERM came (they agree on
        it): a checkpoint is due every save_every steps, at the last step, and when stopped."""
        self.metrics.write(self.record)
        self.stopped = self.stop_signal.requested(self.device)
        due = self.step % self.args.save_every == 0 or self.last() or self.stopped
        return bool(self.args.save_dir) and due

    def should_stop(self):
        if self.stopped:
            step = self.step
            log(f"stopped by SIGTERM after step {step}; with --save_dir, --resume continues it")
        return self.stopped

    def close(self):
        """After the loop. A run shorter than the profiler's schedule writes what it recorded."""
        if self.metrics is None:  # no step was left to train
            self.open()
        self.metrics.close()
        if self.profiler:
            self.profiler.stop()
            log(f"profile: one trace per rank in {self.args.profile}")
