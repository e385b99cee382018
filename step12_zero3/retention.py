"""Which checkpoints a run writes and keeps, the same whatever the layout: one every --save_every
steps, at the last step and after SIGTERM; none begun on a disk it would not fit (--low_disk);
the newest --keep_last, never the one `latest` or `best` names; each captured with
--save_dynamics. What a checkpoint holds, and how it is written and read, is checkpoint.py's.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from checkpoint import latest_checkpoint
from utils import log


def folder_bytes(folder):
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())


def prune_checkpoints(save_dir, keep):
    """Remove all but the newest `keep` checkpoints, never one that `latest` or `best` names nor
    one being written (.step_*.tmp). Each goes by a rename first, so a crash leaves it whole or
    hidden."""
    save_dir = Path(save_dir)
    named = {(save_dir / name).read_text().strip() for name in ["latest", "best"]
             if (save_dir / name).is_file()}  # fmt: skip
    done = sorted(p for p in save_dir.glob("step_*") if p.is_dir())
    for path in done[: max(0, len(done) - keep)]:
        if path.name not in named:
            doomed = path.with_name(f".{path.name}.deleting")
            os.replace(path, doomed)
    for doomed in save_dir.glob(".step_*.deleting"):
        shutil.rmtree(doomed)


DYNAMICS = Path(__file__).resolve().parent.parent / "tools" / "dynamics.py"


class Dynamics:
    """--save_dynamics: each checkpoint, once every rank has written it, is captured by
    `tools/dynamics.py capture` (a probe batch's activations and gradients, the whole tensors,
    into save_dir/dynamics) in a process that rank 0 starts beside the training, which goes on.
    The capture reads the checkpoint's pieces as written, so what it saves is the same in every
    layout. It is waited for before the next checkpoint (so --keep_last never removes one not yet
    captured) and at the run's end; one that fails is reported, and the run goes on."""

    def __init__(self, args):
        self.args, self.process, self.step = args, None, None

    def start(self, step):
        if not self.args.save_dynamics or dist.get_rank() != 0:
            return
        command = [sys.executable, str(DYNAMICS), "capture", self.args.save_dir]
        self.process = subprocess.Popen([*command, "--step", str(step)])
        self.step = step

    def wait(self):
        if self.process is None:
            return
        code, self.process = self.process.wait(), None
        if code != 0:
            log(
                f"warning: --save_dynamics: the capture of step {self.step} failed (exit "
                f"{code}, its message above); `python tools/dynamics.py capture "
                f"{self.args.save_dir}` captures the checkpoints still there"
            )


class Checkpoints:
    """Which checkpoints are written and kept: one every --save_every steps, at the last step and
    after SIGTERM; none begun on a disk it would not fit (--low_disk); the newest --keep_last;
    each captured with --save_dynamics. `replicas`: how many ranks hold the same weights, which a
    checkpoint saves once. `count`: where the step counts them, a function that gives the bytes
    this rank writes into a checkpoint, each piece counted on one rank."""

    def __init__(self, args, device, replicas):
        self.args, self.device, self.replicas = args, device, replicas
        self.count = None
        self.dynamics = Dynamics(args)

    def due(self, step, last, stopped):
        every = step % self.args.save_every == 0
        return bool(self.args.save_dir) and (every or last or stopped)

    def save(self, step, optimizer, write, best=False):
        """Older checkpoints beyond --keep_last go first, then `write()` if the disk holds it;
        `best`: the `best` file then names it (the best validation loss so far)."""
        self.dynamics.wait()  # the last checkpoint captured before --keep_last may remove it
        if self.args.keep_last and dist.get_rank() == 0:  # room for the one about to be written
            prune_checkpoints(self.args.save_dir, self.args.keep_last - 1)
        if self.disk_holds_one(step, optimizer):
            write()
            if best and dist.get_rank() == 0:
                path = Path(self.args.save_dir) / "best"
                path.with_name(".best.tmp").write_text(f"step_{step:06d}")
                os.replace(path.with_name(".best.tmp"), path)  # atomic, like `latest`
            self.dynamics.start(step)

    def disk_holds_one(self, step, optimizer):
        """Whether the disk of save_dir holds one more checkpoint: the size of the last one, or
        before the first, the bytes each rank writes (`count`) summed over the ranks, else an
        estimate from this rank's parameters and optimizer state (summed over the ranks, less
        the replicas' copies). All ranks agree. With --low_disk stop a
        checkpoint that would not fit stops the run; with skip_save the run trains on."""
        args, latest = self.args, latest_checkpoint(self.args.save_dir)
        if latest is not None and latest.is_dir():
            needed = torch.tensor(float(folder_bytes(latest)), device=self.device)
            dist.all_reduce(needed, op=dist.ReduceOp.MAX)
        elif self.count is not None:
            needed = torch.tensor(float(self.count()), device=self.device)
            dist.all_reduce(needed)
        else:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            state = [t for s in optimizer.state.values() for t in s.values()]
            local = sum(t.numel() * t.element_size() for t in params + state if t.dim())
            # AdamW's two moments, before the first step has made them.
            local += 0 if state else 2 * sum(p.numel() * p.element_size() for p in params)
            needed = torch.tensor(float(local), device=self.device)
            dist.all_reduce(needed)
            needed /= self.replicas  # the ranks that hold the same weights save them once
        folder = next(p for p in [Path(args.save_dir), *Path(args.save_dir).parents] if p.exists())
        free = shutil.disk_usage(folder).free
        fits = torch.tensor(float(needed.item() < free), device=self.device)
        dist.all_reduce(fits, op=dist.ReduceOp.MIN)
        if fits.item() == 1.0:
            return True
        message = (
            f"--save_dir {args.save_dir}: a checkpoint of step {step} needs about "
            f"{needed.item():,.0f} bytes and {folder} has {free:,} free"
        )
        if args.low_disk == "skip_save":
            log(f"warning: {message}; not saved (--low_disk skip_save), training goes on")
            return False
        raise ValueError(
            f"{message}. Free some space, keep fewer checkpoints (--keep_last N), or pass "
            f"--low_disk skip_save to train on without saving"
        )

    def close(self):
        self.dynamics.wait()
        if self.args.save_dir and self.args.keep_last and dist.get_rank() == 0:
            prune_checkpoints(self.args.save_dir, self.args.keep_last)
