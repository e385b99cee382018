"""Pipeline parallelism: the decoder layers cut into pp_size consecutive stages, one per rank.

The first stage also owns the embedding, the last the final norm and lm_head. A micro-batch's
activations travel forward from stage to stage (point-to-point send/recv, shapes known in
advance), and their gradients travel back. The schedule decides the order: AFAB runs every
micro-batch of the step forward, then every one backward. 1F1B starts backwards as early as
possible and then alternates one forward with one backward, so a stage holds the activations of
at most pp_size - pp_rank micro-batches instead of all of them, for the same bubble. Each stage
builds only its own layers, with the same names (and so the same initial weights) as in the
single-device model.

Interleaved 1F1B (Megatron-LM's virtual stages) cuts the layers into pp_size x v chunks and gives
rank r chunks r, r + pp_size, ...: a micro-batch goes around the ranks v times, through a v-th of
the layers each time. The pipeline fills and drains with chunk-sized forwards and backwards, v
times shorter, so the idle time is (pp_size - 1) / (v m) of the work instead of (pp_size - 1) / m,
for v times as many messages and a longer warm-up (more activations held on the first ranks).

A tied embedding (`tie_word_embeddings`, one matrix used at both ends of the model) is held twice:
by the first stage as the embedding, by the last as lm_head. `TiedEmbeddings` keeps the two
copies one weight: equal at the start, the same summed gradient at every step.
"""

# B micro-batch, T tokens, D hidden, V vocab

import argparse
from contextlib import nullcontext
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from pipeline_timeline import NoTimeline
from placement import Held, place, record_of
from process_group_manager import group_ranks
from zero_bubble import deferred, weight_gradients


def stage_layers(num_layers, pp_rank, pp_size):
    """The layers of stage pp_rank: consecutive, balanced, the first stages taking one more when
    pp_size does not divide num_layers (5 layers over 2 stages: 0-2, 3-4)."""
    per_stage, extra = divmod(num_layers, pp_size)
    start = pp_rank * per_stage + min(pp_rank, extra)
    return range(start, start + per_stage + (pp_rank < extra))


def rank_chunks(num_layers, pp_rank, pp_size, chunks=1):
    """The layers of each of rank pp_rank's chunks: the model cut into pp_size x chunks stages,
    chunk c being stage c * pp_size + pp_rank (8 layers, pp 2, 2 chunks: rank 0 holds layers 0-1
    and 4-5, rank 1 layers 2-3 and 6-7)."""
    stages = pp_size * chunks
    return [stage_layers(num_layers, c * pp_size + pp_rank, stages) for c in range(chunks)]


def check_pipeline_parallel(config, pp_size, chunks=1):
    if pp_size * chunks > config.num_hidden_layers:
        raise ValueError(
            f"pp_size x pp_virtual_stages = {pp_size} x {chunks} = {pp_size * chunks} chunks of "
            f"layers is more than num_hidden_layers={config.num_hidden_layers}: every chunk "
            f"needs at least one layer"
        )


def keep_stage(model, pgm, chunks=1):
    """Drop what this stage does not run, its `chunks` chunks of layers kept. Call it on the meta
    device, before any weight exists. The layers kept are keyed by their global index, so their
    state-dict names are those of the single-device model. With tied embeddings the last stage's
    lm_head keeps the weight that the dropped embedding shared: from now on a parameter of its
    own, the copy."""
    layers = rank_chunks(len(model.model.layers), pgm.pp_rank, pgm.pp_size, chunks)
    layers = [i for chunk in layers for i in chunk]
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
    (last stage) logits out. `chunks`: the global indices of the layers of each of this rank's
    chunks (`rank_chunks`), in order; one chunk of every layer kept by default. The first chunk
    starts with the embedding where the rank holds it, the last ends with the norm and lm_head."""

    def __init__(self, model, chunks=None):
        super().__init__()
        self.model = model
        self.chunks = [list(model.model.layers)] if chunks is None else chunks
        self.chunks = [[str(i) for i in layers] for layers in self.chunks]

    def forward(self, x, chunk=0):
        inner = self.model.model
        if chunk == 0 and inner.embed_tokens is not None:
            x = inner.embed_tokens(x)  # (B, T) -> (B, T, D)
        for name in self.chunks[chunk]:
            x = inner.layers[name](x)
        if chunk == len(self.chunks) - 1 and self.model.lm_head is not None:
            x = self.model.lm_head(inner.norm(x))  # (B, T, V/tp)
        return x


### begin Communication
class Recv:
    """A receive posted now, filled in the background, waited for when its tensor is needed."""

    def __init__(self, shape, peer, device, group=None):
        self.tensor = torch.empty(shape, device=device)  # activations travel in fp32
        self.work = dist.irecv(self.tensor, src=peer, group=group)

    def wait(self):
        self.work.wait()
        return self.tensor


class Send:
    """A send started now: the stage goes on computing while the tensor travels."""

    def __init__(self, tensor, peer, group=None):
        self.tensor = tensor.contiguous()  # kept alive until the send is done
        self.work = dist.isend(self.tensor, dst=peer, group=group)

    def wait(self):
        self.work.wait()


def gradient_group(pgm):
    """A second process group over this rank's pipeline, for the gradients going back; the
    activations go forward on the default group. Between two ranks, the messages of one group
    are matched in the order they were posted, and with chunks around the ring the same two ranks
    can send each other both (at pp_size 2, rank 1 sends rank 0 the activations of its chunk 0 and
    the gradients of its input), each kind in its own order: a group each keeps them apart, on
    NCCL as on gloo. Every rank makes every pipeline's group, in the same order."""
    mine = None
    for ranks in group_ranks(pgm.grid, "pp").tolist():
        group = dist.new_group(ranks, timeout=pgm.timeout)
        if pgm.global_rank in ranks:
            mine = group
    return mine


### end Communication
def forward_step(model, inputs, shape, pgm, device):
    """One micro-batch through this rank's chunks in turn (`model`: a PipelineParallel), forward
    only (evaluation, sampling); returns its last chunk's input and output."""
    for chunk in range(len(model.chunks)):
        stage = Stage(model, pgm, chunk, len(model.chunks))
        x = inputs if stage.is_first else Recv(shape, stage.prev_rank, device).wait()
        y = stage.forward(x)
        if not stage.is_last:
            Send(y.detach().float(), stage.next_rank).wait()  # the residual stream, in fp32
    return x, y


### begin Schedules
class Action(NamedTuple):
    """One entry of a schedule: the forward ("F") or backward ("B") of micro-batch k through
    chunk c of this rank's layers (a rank with several chunks holds chunks r, r + pp_size, ... of
    the pipeline). A schedule that splits the backward has "B" compute the gradient of the chunk's
    input only and "W" the gradients of its weights (zero_bubble.py)."""

    kind: str
    micro_batch: int
    chunk: int = 0

    def __str__(self):  # F1 B1 ..., counted from 1; a chunk other than 0 as F1.c1
        return f"{self.kind}{self.micro_batch + 1}" + (f".c{self.chunk}" if self.chunk else "")


def afab(pp_size, m, chunks=1):
    """All forward, then all backward: every stage runs F1 ... Fm, then B1 ... Bm."""
    forwards = [Action("F", k) for k in range(m)]
    backwards = [Action("B", k) for k in range(m)]
    return [forwards + backwards for _ in range(pp_size)]


def one_f_one_b(pp_size, m, chunks=1):
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


def interleaved_1f1b(pp_size, m, chunks):
    """1F1B over `chunks` chunks per rank (m a multiple of pp_size). Every rank runs the forwards
    in the same order: micro-batches in groups of pp_size, each group through chunk 0, then chunk
    1, ...; the backwards in the same groups, the chunks in reverse. Rank r warms up with
    (chunks - 1) x pp_size forwards, the first group through every chunk but the last, and 2 per
    rank after it: by then the first backward's gradient can have come back from the last rank.
    Then one forward, one backward; then the backwards left."""
    total = m * chunks

    def order(kind, i):  # the i-th forward (or backward) of every rank
        group, within = divmod(i, pp_size * chunks)
        chunk = within // pp_size if kind == "F" else chunks - 1 - within // pp_size
        return Action(kind, group * pp_size + within % pp_size, chunk)

    schedules = []
    for r in range(pp_size):
        warmup = min((chunks - 1) * pp_size + 2 * (pp_size - r - 1), total)
        actions = [order("F", i) for i in range(warmup)]
        for i in range(warmup, total):  # steady state
            actions += [order("F", i), order("B", i - warmup)]
        actions += [order("B", j) for j in range(total - warmup, total)]  # cool-down
        schedules.append(actions)
    return schedules


def zero_bubble_h1(pp_size, m, chunks=1):
    """ZB-H1: 1F1B with each backward split into B, the input's gradient, which the stage before
    waits for, and W, the weights' gradients, which nobody waits for. Rank r warms up as in 1F1B;
    in the steady state it runs F B, and from its (r + 1)-th on also the W of the oldest
    micro-batch whose W is pending: it holds r W's back. They run at the end, where 1F1B's
    cool-down left rank r idle while the gradients travelled from the last rank (2 r B-lengths
    there; r W's fill about half of it). The same order as PyTorch's
    ScheduleInterleavedZeroBubble with one stage per rank."""
    schedules = []
    for r in range(pp_size):
        warmup = min(pp_size - r - 1, m)
        actions, weights = [Action("F", k) for k in range(warmup)], 0
        for i, k in enumerate(range(warmup, m)):  # steady state
            actions += [Action("F", k), Action("B", k - warmup)]
            if i >= r:
                actions.append(Action("W", weights))
                weights += 1
        for k in range(m - warmup, m):  # cool-down
            actions.append(Action("B", k))
            if k >= r:  # k: the steps since the steady state began
                actions.append(Action("W", weights))
                weights += 1
        actions += [Action("W", k) for k in range(weights, m)]  # the W's held back
        schedules.append(actions)
    return schedules


# A schedule: (pp_size, m, chunks per rank) -> each rank's list of actions, in the order the rank
# runs them.
SCHEDULES = {
    "afab": afab,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
    "zb1": zero_bubble_h1,
}
SPLIT_BACKWARD = {"zb1"}  # the schedules whose actions include W


def check_schedule(parser, args):
    """Refuse, before anything runs, a schedule these sizes cannot run."""
    engine, v, m = args.pp_engine, args.pp_virtual_stages, args.gradient_accumulation_steps
    if v < 1:
        parser.error(f"--pp_virtual_stages must be at least 1, got {v}")
    if engine in SPLIT_BACKWARD and args.compile:
        parser.error(
            f"--pp_engine {engine} splits the backward in autograd functions that torch.compile "
            f"does not trace: drop --compile, or use --pp_engine 1f1b"
        )
    if engine != "interleaved":
        if v > 1:
            parser.error(
                f"--pp_virtual_stages {v} is for --pp_engine interleaved; {engine} runs one "
                f"chunk of layers per rank"
            )
        return
    if args.pp_size < 2 or v < 2:
        parser.error(
            f"--pp_engine interleaved needs --pp_size 2 or more and --pp_virtual_stages 2 or "
            f"more (got {args.pp_size} and {v}); with one chunk per rank use --pp_engine 1f1b"
        )
    if m % args.pp_size:
        parser.error(
            f"--pp_engine interleaved sends the micro-batches around in groups of pp_size: "
            f"--gradient_accumulation_steps {m} is not a multiple of --pp_size {args.pp_size}"
        )


def frees(actions):
    """The kind of action after which a micro-batch's activations are gone: its W where the
    backward is split (B leaves what W reads: the inputs of the linear layers and the gradients
    of their outputs), else its B."""
    return "W" if any(action.kind == "W" for action in actions) else "B"


def held(actions):
    """The most micro-batches whose activations the actions hold at once (forwards whose
    backward, or W, has not run yet)."""
    count, peak, last = 0, 0, frees(actions)
    for action in actions:
        count += 1 if action.kind == "F" else -1 if action.kind == last else 0
        peak = max(peak, count)
    return peak


def table(name, pp_size, m, chunks=1):
    """One line per stage: the actions of the schedule, and how many micro-batches it holds."""
    lines = []
    for r, actions in enumerate(SCHEDULES[name](pp_size, m, chunks)):
        order = " ".join(map(str, actions))
        lines.append(
            f"{name.upper() if r == 0 else '':<12}stage {r:<6}{order}   held {held(actions)}"
        )
    return "\n".join(lines)


### end Schedules
class Stage:
    """The seam between the executor and the model: one chunk of this rank's layers, its forward
    and its backward. Its place in the pipeline is chunk * pp_size + pp_rank: the first takes the
    token ids, the last computes the loss; the stage before it is on the previous rank, the one
    after on the next, around the ring (the last rank's chunk c feeds rank 0's chunk c + 1).
    `gradients`: the group the gradients travel on (`gradient_group`; None: the default one)."""

    def __init__(self, model, pgm, chunk=0, chunks=1, gradients=None):
        self.model, self.chunk, self.gradients = model, chunk, gradients
        index = chunk * pgm.pp_size + pgm.pp_rank
        self.is_first, self.is_last = index == 0, index == chunks * pgm.pp_size - 1
        self.prev_rank = pgm.pp_group_ids[(pgm.pp_rank - 1) % pgm.pp_size]
        self.next_rank = pgm.pp_group_ids[(pgm.pp_rank + 1) % pgm.pp_size]

    def forward(self, x):
        return self.model(x, self.chunk)

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
    saved = {}  # (chunk, k) -> (x, y), kept until the backward
    # Split backward (W actions): B leaves each weight gradient as a closure, run by the W.
    split, waiting = frees(actions) == "W", {}  # (chunk, k) -> the closures of its W
    # The action that completes a chunk's weight gradients, counted: data-parallel gradients are
    # averaged once, during the chunk's last one.
    finishing, finished = "W" if split else "B", [0] * len(stages)
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

    def send(direction, tensor, peer, group=None):
        with timeline.blocked("send"):
            if sending[direction] is not None:
                sending[direction].wait()
            sending[direction] = Send(tensor, peer, group)

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
            if action.kind == finishing:  # the gradients' hooks run in this one
                stage.model.require_backward_grad_sync = finished[action.chunk] == m - 1
                finished[action.chunk] += 1
            if action.kind == "W":
                with timeline.run(action):
                    weight_gradients(waiting.pop((action.chunk, k)))
                continue
            x, y = saved.pop((action.chunk, k))
            with timeline.blocked("receive", not stage.is_last):
                peer = stage.next_rank
                grad = None if stage.is_last else Recv(shape, peer, device, stage.gradients).wait()
            with timeline.run(action), deferred([]) if split else nullcontext() as closures:
                grad_input = stage.backward(x, y, grad)
            if split:
                waiting[action.chunk, k] = closures
            if not stage.is_first:
                send("backward", grad_input, stage.prev_rank, stage.gradients)
    assert not saved and not waiting, "every forward's backward ran, and every W"
    assert receiving is None, "every input arrived"
    with timeline.blocked("send", any(sending.values())):
        for last_send in sending.values():
            if last_send is not None:
                last_send.wait()
    return total


if __name__ == "__main__":  # the schedules' tables: python pipeline_parallel.py --pp_size 4
    parser = argparse.ArgumentParser(description="print each stage's actions in every schedule")
    parser.add_argument("--pp_size", type=int, default=4, help="stages")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=8, help="m")
    parser.add_argument("--pp_virtual_stages", type=int, default=2, help="v, for interleaved")
    args = parser.parse_args()
    p, m, v = args.pp_size, args.gradient_accumulation_steps, args.pp_virtual_stages
    if min(p, m, v) < 1:
        parser.error(
            f"--pp_size, --gradient_accumulation_steps and --pp_virtual_stages must be at least "
            f"1, got {p}, {m} and {v}"
        )
    tables = [table(name, p, m) for name in ["afab", "1f1b"]]
    if m % p == 0:  # interleaved sends the micro-batches around in groups of pp_size
        tables.append(table("interleaved", p, m, v))
    tables.append(table("zb1", p, m))
    print("\n".join(tables))
