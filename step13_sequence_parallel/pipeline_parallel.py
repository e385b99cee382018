"""Pipeline parallelism: the decoder layers cut into pp_size consecutive stages, one per rank.

The first stage also owns the embedding, the last the final norm and lm_head. A micro-batch's
activations travel forward from stage to stage (point-to-point send/recv, shapes known in
advance), and their gradients travel back. The schedule decides the order: AFAB runs every
micro-batch of the step forward, then every one backward. 1F1B starts backwards as early as
possible and then alternates one forward with one backward, so a stage holds the activations of
at most pp_size - pp_rank micro-batches instead of all of them, for the same bubble. Each stage
builds only its own layers, with the same names (and so the same initial weights) as in the
single-device model.

A tied embedding (`tie_word_embeddings`, one matrix used at both ends of the model) is held twice:
by the first stage as the embedding, by the last as lm_head. `TiedEmbeddings` keeps the two
copies one weight: equal at the start, the same summed gradient at every step.
"""

# B micro-batch, T tokens, D hidden, V vocab

import argparse
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from pipeline_timeline import NoTimeline
from placement import Held, place, record_of


def stage_layers(num_layers, pp_rank, pp_size):
    """The layers of stage pp_rank: consecutive, balanced, the first stages taking one more when
    pp_size does not divide num_layers (5 layers over 2 stages: 0-2, 3-4)."""
    per_stage, extra = divmod(num_layers, pp_size)
    start = pp_rank * per_stage + min(pp_rank, extra)
    return range(start, start + per_stage + (pp_rank < extra))


def check_pipeline_parallel(config, pp_size):
    if pp_size > config.num_hidden_layers:
        raise ValueError(
            f"pp_size={pp_size} is larger than num_hidden_layers={config.num_hidden_layers}: "
            f"every stage needs at least one layer"
        )


def keep_stage(model, pgm):
    """Drop what this stage does not run. Call it on the meta device, before any weight exists.
    The layers kept are keyed by their global index, so their state-dict names are those of the
    single-device model. With tied embeddings the last stage's lm_head keeps the weight that the
    dropped embedding shared: from now on a parameter of its own, the copy."""
    layers = stage_layers(len(model.model.layers), pgm.pp_rank, pgm.pp_size)
    model.model.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in layers})
    if not pgm.pp_is_first_stage:
        model.model.embed_tokens = None
    if not pgm.pp_is_last_stage:
        model.model.norm, model.lm_head = None, None
    for module in model.modules():  # what is left lives on this stage alone
        for name, _ in module.named_parameters(recurse=False):
            place(module, name, *record_of(module, name), Held("pp", pgm.pp_rank))
    return model


### begin Tied embeddings
class TiedEmbeddings:
    """One weight, the embedding and lm_head, split between the first and the last stage.

    Each of the two stages holds a copy. The copies start equal (the first stage's is broadcast to
    the last) and get the same update: after the data-parallel average, their gradients are summed
    over the two stages, which is the gradient of the one shared weight of a single device (the
    sum of what the embedding and lm_head contribute). With the same gradient and the same AdamW
    state they stay bit-identical. Nothing to do with one stage (the weight is shared), an untied
    config, or on the stages in between.
    """

    def __init__(self, model, pgm):
        self.group, self.weight, self.counted = None, None, model
        if not (model.config.tie_word_embeddings and pgm.pp_size > 1):
            return
        # The embedding group: the first and last stage of each pipeline, one per (dp_rank,
        # cp_rank, tp_rank): tp rank t's copies hold the same vocabulary rows. Every rank creates
        # every group, in the same order, even those it is not part of.
        for ranks in pgm.grid[:, [0, -1]].movedim(1, -1).reshape(-1, 2).tolist():
            group = dist.new_group(ranks, timeout=pgm.timeout)
            if pgm.global_rank in ranks:
                self.group, self.first_rank = group, ranks[0]
        if pgm.pp_is_first_stage:
            self.weight = model.model.embed_tokens.weight
        elif pgm.pp_is_last_stage:
            self.weight = model.lm_head.weight
            # The gradient norm counts the weight once, on the first stage: here all but lm_head.
            self.counted = model.model
        if self.weight is not None:  # the copy starts as the first stage's weight
            with torch.no_grad():
                dist.broadcast(self.weight, src=self.first_rank, group=self.group)

    def sum_gradients(self):
        """Call after the data-parallel sync, before clipping: both copies get the sum."""
        if self.weight is not None:
            dist.all_reduce(self.weight.grad, group=self.group)


### end Tied embeddings
class PipelineParallel(nn.Module):
    """This stage's forward: token ids or the previous stage's activations in, activations or
    (last stage) logits out."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        inner = self.model.model
        if inner.embed_tokens is not None:
            x = inner.embed_tokens(x)  # (B, T) -> (B, T, D)
        for layer in inner.layers.values():
            x = layer(x)
        if self.model.lm_head is not None:
            x = self.model.lm_head(inner.norm(x))  # (B, T, V/tp)
        return x


### begin Communication
class Recv:
    """A receive posted now, filled in the background, waited for when its tensor is needed."""

    def __init__(self, shape, peer, device):
        self.tensor = torch.empty(shape, device=device)  # activations travel in fp32
        self.work = dist.irecv(self.tensor, src=peer)

    def wait(self):
        self.work.wait()
        return self.tensor


class Send:
    """A send started now: the stage goes on computing while the tensor travels."""

    def __init__(self, tensor, peer):
        self.tensor = tensor.contiguous()  # kept alive until the send is done
        self.work = dist.isend(self.tensor, dst=peer)

    def wait(self):
        self.work.wait()


### end Communication
def forward_step(model, inputs, shape, pgm, device):
    """One micro-batch through this stage, forward only (evaluation, sampling); returns (this
    stage's input, its output)."""
    x = inputs if pgm.pp_is_first_stage else Recv(shape, pgm.pp_prev_rank, device).wait()
    y = model(x)
    if not pgm.pp_is_last_stage:
        Send(y.detach().float(), pgm.pp_next_rank).wait()  # the residual stream, in fp32
    return x, y


### begin Schedules
class Action(NamedTuple):
    """One entry of a schedule: the forward ("F") or backward ("B") of micro-batch k through
    chunk c of this rank's layers (one chunk per rank here; a rank with several holds chunks r,
    r + pp_size, ... of the pipeline). A schedule that splits the backward would add a kind."""

    kind: str
    micro_batch: int
    chunk: int = 0

    def __str__(self):  # F1 B1 ..., counted from 1; a chunk other than 0 as F1.c1
        return f"{self.kind}{self.micro_batch + 1}" + (f".c{self.chunk}" if self.chunk else "")


def afab(pp_size, m):
    """All forward, then all backward: every stage runs F1 ... Fm, then B1 ... Bm."""
    forwards = [Action("F", k) for k in range(m)]
    backwards = [Action("B", k) for k in range(m)]
    return [forwards + backwards for _ in range(pp_size)]


def one_f_one_b(pp_size, m):
    """One forward, one backward. Stage r runs pp_size - r - 1 forwards of warm-up before its
    first backward: the micro-batches that must be on their way for the last stage to start its
    first backward right after its first forward (never more than there are micro-batches).
    Then one forward and one backward, the oldest held; then the backwards left."""
    schedules = []
    for r in range(pp_size):
        warmup = min(pp_size - r - 1, m)
        actions = [Action("F", k) for k in range(warmup)]
        for k in range(warmup, m):  # steady state
            actions += [Action("F", k), Action("B", k - warmup)]
        actions += [Action("B", k) for k in range(m - warmup, m)]  # cool-down
        schedules.append(actions)
    return schedules


# A schedule: (pp_size, m) -> each rank's list of actions, in the order the rank runs them.
SCHEDULES = {"afab": afab, "1f1b": one_f_one_b}


def held(actions):
    """The most micro-batches whose activations the actions hold at once (forwards whose
    backward has not run yet)."""
    count, peak = 0, 0
    for action in actions:
        count += 1 if action.kind == "F" else -1
        peak = max(peak, count)
    return peak


def table(name, pp_size, m):
    """One line per stage: the actions of the schedule, and how many micro-batches it holds."""
    lines = []
    for r, actions in enumerate(SCHEDULES[name](pp_size, m)):
        order = " ".join(map(str, actions))
        lines.append(
            f"{name.upper() if r == 0 else '':<7}stage {r:<6}{order}   held {held(actions)}"
        )
    return "\n".join(lines)


### end Schedules
class Stage:
    """The seam between the executor and the model: one chunk of this rank's layers, its forward
    and its backward. Its place in the pipeline is chunk * pp_size + pp_rank: the first takes the
    token ids, the last computes the loss; the stage before it is on the previous rank, the one
    after on the next, around the ring (the last rank's chunk c feeds rank 0's chunk c + 1)."""

    def __init__(self, model, pgm, chunk=0, chunks=1):
        self.model = model
        index = chunk * pgm.pp_size + pgm.pp_rank
        self.is_first, self.is_last = index == 0, index == chunks * pgm.pp_size - 1
        self.prev_rank = pgm.pp_group_ids[(pgm.pp_rank - 1) % pgm.pp_size]
        self.next_rank = pgm.pp_group_ids[(pgm.pp_rank + 1) % pgm.pp_size]

    def forward(self, x):
        return self.model(x)

    def backward(self, x, y, grad):
        """Backward from y's gradient (None when y is the loss: it starts from 1). Returns the
        gradient of the input x, for the stage before (None on the first stage)."""
        torch.autograd.backward(y, grad_tensors=grad)
        return None if self.is_first else x.grad


def run_schedule(actions, stages, micro_batches, loss_fn, shape, device, dtype, timeline=None):
    """Run this rank's actions in order, `stages` its chunks of layers; `timeline` records what
    ran (pipeline_timeline.py). Returns the step's loss on the last stage (zero elsewhere).

    The messages never block the computation: a forward's input is received one forward ahead
    (its receive posted before the forward before it computes), every send is started and left
    to travel. Two neighbours then post the messages between them in the same order (NCCL carries
    them out in the order posted, and a receive facing a receive would wait for ever): a
    gradient's receive is posted only when its backward needs it."""
    timeline = timeline or NoTimeline()
    m, total = len(micro_batches), torch.zeros((), device=device)
    saved, backwards = {}, [0] * len(stages)  # (chunk, k) -> (x, y), kept until the backward
    # The inputs to receive, one per forward of a stage that is not the first, in order: each
    # `next` posts one. The first is posted now, each next one before the forward before it.
    receives = (
        Recv(shape, stages[a.chunk].prev_rank, device)
        for a in actions
        if a.kind == "F" and not stages[a.chunk].is_first
    )
    receiving = next(receives, None)
    # The previous send each way is waited for before the next one starts (it is normally done
    # by then): at most one copy per direction in flight, and all done when the step returns.
    sending = {"forward": None, "backward": None}

    def send(direction, tensor, peer):
        with timeline.blocked("send"):
            if sending[direction] is not None:
                sending[direction].wait()
            sending[direction] = Send(tensor, peer)

    for action in actions:
        stage, k = stages[action.chunk], action.micro_batch
        if action.kind == "F":
            x, targets = micro_batches[k]
            if not stage.is_first:
                with timeline.blocked("receive"):
                    x = receiving.wait().requires_grad_()  # a leaf: its gradient goes back
                receiving = next(receives, None)  # arrives while this forward computes
            with (
                timeline.run(action),
                torch.autocast(device.type, dtype, enabled=dtype != torch.float32),
            ):
                y = stage.forward(x)
                if stage.is_last:
                    # Divided by the number of micro-batches, as in step 3: the gradients are then
                    # those of one process with the same accumulation, not m times larger.
                    y = loss_fn(y, targets) / m
                    total += y.detach()
            if not stage.is_last:
                send("forward", y.detach().float(), stage.next_rank)  # in fp32: the residual
            saved[action.chunk, k] = (x, y)
        else:
            x, y = saved.pop((action.chunk, k))
            with timeline.blocked("receive", not stage.is_last):
                grad = None if stage.is_last else Recv(shape, stage.next_rank, device).wait()
            # Data-parallel gradients are averaged once, during the chunk's last backward.
            stage.model.require_backward_grad_sync = backwards[action.chunk] == m - 1
            backwards[action.chunk] += 1
            with timeline.run(action):
                grad_input = stage.backward(x, y, grad)
            if not stage.is_first:
                send("backward", grad_input, stage.prev_rank)
    assert not saved and receiving is None, "every forward's backward ran, every input arrived"
    with timeline.blocked("send", any(sending.values())):
        for last_send in sending.values():
            if last_send is not None:
                last_send.wait()
    return total


if __name__ == "__main__":  # the schedules' tables: python pipeline_parallel.py --pp_size 4
    parser = argparse.ArgumentParser(description="print each stage's actions in every schedule")
    parser.add_argument("--pp_size", type=int, default=4, help="stages")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=8, help="m")
    args = parser.parse_args()
    if args.pp_size < 1 or args.gradient_accumulation_steps < 1:
        parser.error(
            f"--pp_size and --gradient_accumulation_steps must be at least 1, got "
            f"{args.pp_size} and {args.gradient_accumulation_steps}"
        )
    print(
        "\n".join(table(name, args.pp_size, args.gradient_accumulation_steps) for name in SCHEDULES)
    )
