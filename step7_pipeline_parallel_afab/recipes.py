"""What a run does with its numbers between steps, the same whatever the layout: the learning
rate's schedule (--lr_schedule), the stop once the validation loss stalls
(--early_stopping_patience), fp16's dynamic loss scale (--dtype float16), and a step whose loss or
gradient norm is not finite, which is never applied (--on_nonfinite). `bookkeeping.Run` asks each
of them after every step.
"""

import math

import torch

from checkpoint import latest_checkpoint
from utils import log


def lr_factor(args, max_steps):
    """The learning rate's factor at each step: linear warm-up over --warmup_steps, then down to
    10 % at `max_steps`: a cosine, or with --lr_schedule wsd (warmup-stable-decay) flat until the
    last --decay_fraction of the steps, then a straight line. WSD's rate does not depend on the
    length of the run until its decay: a checkpoint taken before it can be trained on for longer,
    or decayed early, without starting again."""
    warmup = args.warmup_steps
    decay_start = max(warmup, max_steps - round(args.decay_fraction * max_steps))

    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        if args.lr_schedule == "wsd":
            progress = (step - decay_start) / max(1, max_steps - decay_start)
            return 1.0 - 0.9 * min(1.0, max(0.0, progress))
        progress = (step - warmup) / max(1, max_steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def warmup_cosine(optimizer, args):
    """--learning_rate after a linear warm-up over --warmup_steps, then the --lr_schedule down to
    10 % at --max_steps (a resume may move the last step: `Run.resumed` gives the schedule the new
    one)."""
    factor = lr_factor(args, args.max_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class EarlyStop:
    """--early_stopping_patience N: the run stops, saving its last step, once N validations in a
    row have not lowered the best validation loss so far; with --save_dir each validation that
    does is saved, and the file `best` names it. The count starts again after a resume."""

    def __init__(self, args):
        self.patience, self.best, self.best_step = args.early_stopping_patience, None, 0
        self.waited, self.stopped, self.improved = 0, False, False

    def check(self, step, val_loss):
        """After each step, with its validation loss (None: the step did not validate)."""
        self.improved = False
        if not self.patience or val_loss is None:
            return
        if self.best is None or val_loss < self.best:
            self.best, self.best_step, self.waited = val_loss, step, 0
            self.improved = True
            return
        self.waited += 1
        if self.waited >= self.patience:
            self.stopped = True
            log(
                f"step {step}: the validation loss has not gone below {self.best:.4f} (step "
                f"{self.best_step}) in {self.waited} validations: stopping early "
                f"(--early_stopping_patience {self.patience})"
            )


### begin Loss scaling
class LossScale:
    """--dtype float16: dynamic loss scaling. fp16 holds numbers from 6e-8 to 65,504, and small
    gradients of the activations would round to zero; the loss is multiplied by the scale S
    before backward, so every gradient is S times larger, and the weights' gradients are divided
    by S before the update. S is a power of two, so both products are exact. A step whose
    gradient norm overflows on some rank (`agree` reduces it over every rank: each rank's own
    check would let the others apply a step that one of them must skip) is skipped on every rank
    and S halves; after GROWTH_INTERVAL finite steps in a row S doubles. S and that count live in
    the optimizer's first parameter group, so every checkpoint keeps them. Without float16 S is
    1: every product by it changes nothing."""

    INITIAL, GROWTH_INTERVAL, MAX_OVERFLOWS = 2.0**16, 2000, 24

    def __init__(self, args):
        self.enabled, self.overflows = args.dtype == "float16", 0

    def start(self, optimizer):
        """The scale's first value, unless a checkpoint brought one."""
        if self.enabled:
            optimizer.param_groups[0].setdefault("loss_scale", self.INITIAL)
            optimizer.param_groups[0].setdefault("finite_in_a_row", 0)

    def update(self, facts, optimizer, step, record):
        """After the step: halve on an overflow, double after enough finite steps. Returns why
        the run must stop (an overflow MAX_OVERFLOWS times in a row: not a matter of scale), or
        None."""
        if not self.enabled:
            return None
        group = optimizer.param_groups[0]
        record["loss_scale"] = group["loss_scale"]
        if facts.finite:
            self.overflows = 0
            group["finite_in_a_row"] += 1
            if group["finite_in_a_row"] == self.GROWTH_INTERVAL:
                group.update(loss_scale=2 * group["loss_scale"], finite_in_a_row=0)
        elif facts.loss_finite:  # the gradients overflowed: skipped on every rank, S halves
            self.overflows += 1
            group.update(loss_scale=group["loss_scale"] / 2, finite_in_a_row=0)
            record["overflow"] = True
            log(
                f"step {step}: the gradients overflowed fp16 at loss scale "
                f"{record['loss_scale']:g} on some rank; the step is skipped on every rank and "
                f"the scale halves"
            )
            if self.overflows > self.MAX_OVERFLOWS:
                return (
                    f"step {step}: the gradients overflowed {self.overflows} steps in a row, down "
                    f"to loss scale {group['loss_scale']:g}: they are not finite at any scale. "
                    f"A lower --learning_rate, or --dtype bfloat16, may help"
                )
        return None


def loss_scale(optimizer):
    """The number the loss is multiplied by before backward: 1 unless --dtype float16."""
    return optimizer.param_groups[0].get("loss_scale", 1.0)


@torch.no_grad()
def unscale(optimizer, scale):
    """Divide every gradient the optimizer reads by the loss scale, before its step."""
    if scale != 1.0:
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.grad.div_(scale)


### end Loss scaling


class NonFiniteGuard:
    """--on_nonfinite: train_step applied no update if the loss or the gradient norm was not
    finite on some rank (`agree`); here the run counts the skip, or stops before anything is
    validated or saved."""

    def __init__(self, args):
        self.args, self.skipped, self.in_a_row = args, 0, 0

    def check(self, facts, step, record):
        """Adds the skips to the step's `record`; returns why the run must stop, or None."""
        if facts.finite:
            self.in_a_row = 0
            if self.skipped:  # the log counts the skips so far
                record["skipped_steps"] = self.skipped
            return None
        if facts.loss_finite and self.args.dtype == "float16":  # an overflow: LossScale's
            return None
        args, what = self.args, "the gradient norm" if facts.loss_finite else "the loss"
        self.skipped, self.in_a_row = self.skipped + 1, self.in_a_row + 1
        record.update(skipped=True, skipped_steps=self.skipped)
        if args.on_nonfinite == "skip" and self.in_a_row <= args.max_nonfinite_skips:
            log(
                f"step {step}: {what} is not finite on some rank; its update is skipped on "
                f"every rank ({self.in_a_row} in a row, at most {args.max_nonfinite_skips})"
            )
            return None
        latest = latest_checkpoint(args.save_dir) if args.save_dir else None
        last = f"the last checkpoint, {latest}, is as it was" if latest else "no checkpoint"
        if args.on_nonfinite == "skip":
            what = f"{what} ({self.in_a_row} steps in a row)"
        return (
            f"step {step}: {what} is not finite on some rank: the run stops before applying "
            f"it and saves nothing ({last}). A lower --learning_rate or --grad_clip may help; "
            f"--on_nonfinite skip skips such steps"
        )
