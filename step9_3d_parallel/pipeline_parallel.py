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

import json
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from tensor_parallel import grad_squares
from utils import log


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
        # tp_rank): tp rank t's copies hold the same vocabulary rows. Every rank creates every
        # group, in the same order, even those it is not part of.
        for ranks in pgm.grid[:, [0, -1], :].transpose(1, 2).reshape(-1, 2).tolist():
            group = dist.new_group(ranks)
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
def recv_forward(shape, pgm, device):
    """The previous stage's activations; they will need a gradient, to be sent back."""
    if pgm.pp_is_first_stage:
        return None
    x = torch.empty(shape, device=device)  # activations travel in fp32 (the residual stream)
    dist.recv(x, src=pgm.pp_prev_rank)
    return x.requires_grad_()


def send_forward(y, pgm):
    if not pgm.pp_is_last_stage:
        dist.send(y.detach().float().contiguous(), dst=pgm.pp_next_rank)


def recv_backward(shape, pgm, device):
    """The gradient of this stage's output, from the next stage (none on the last: the loss)."""
    if pgm.pp_is_last_stage:
        return None
    grad = torch.empty(shape, device=device)
    dist.recv(grad, src=pgm.pp_next_rank)
    return grad


def send_backward(grad, pgm):
    if not pgm.pp_is_first_stage:
        dist.send(grad.contiguous(), dst=pgm.pp_prev_rank)


class Recv:
    """A receive posted now, filled in the background, waited for when its tensor is needed."""

    def __init__(self, shape, peer, device):
        self.tensor = torch.empty(shape, device=device)
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
    """One micro-batch through this stage; returns (this stage's input, its output)."""
    x = inputs if pgm.pp_is_first_stage else recv_forward(shape, pgm, device)
    y = model(x)
    send_forward(y, pgm)
    return x, y


class Schedule:
    """What a stage did during one step: the order of its forwards and backwards (the timeline,
    F1 F2 B1 ...), the peak number of micro-batches whose activations it held at once, and when
    each ran, the rest of the step being the bubble; within the bubble, when the stage was held
    up by a send or by a receive (waiting for a neighbour)."""

    def __init__(self):
        self.timeline, self.in_flight, self.peak_in_flight = [], 0, 0
        # (kind, micro-batch, start, end) in nanoseconds of the wall clock, which every rank of a
        # machine shares, so that the stages' spans line up in one picture.
        self.spans, self.messages, self.start = [], [], time.time_ns()

    @contextmanager
    def run(self, kind, k):
        start = time.time_ns()
        yield
        self.spans.append((kind, k, start, time.time_ns()))
        self.timeline.append(f"{kind}{k + 1}")
        self.in_flight += 1 if kind == "F" else -1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

    @contextmanager
    def blocked(self, kind, active=True):
        """The stage waits on a "send" or a "receive" (when `active`: a stage with no neighbour
        on that side does not)."""
        start = time.time_ns()
        yield
        if active:
            self.messages.append((kind, None, start, time.time_ns()))

    def bubble(self):
        busy = sum(end - start for _, _, start, end in self.spans)
        return 1.0 - busy / (time.time_ns() - self.start)

    def trace_events(self, stage, end):
        """This stage's step as Chrome trace events (microseconds, one track per stage): a span
        per forward, backward, blocking send and receive, and one per gap left between them
        (the loop itself: posting messages, the loss)."""
        events, previous = [], self.start
        spans = sorted([*self.spans, *self.messages], key=lambda span: span[2])
        for kind, k, start, stop in [*spans, ("end", None, end, end)]:
            if start > previous:
                events.append(span("other", "other", previous, start, stage))
            if kind in ("F", "B"):
                name, category = f"{kind}{k + 1}", "forward" if kind == "F" else "backward"
                events.append(span(name, category, start, stop, stage, micro_batch=k + 1))
            elif kind != "end":
                events.append(span(kind, kind, start, stop, stage))
            previous = max(previous, stop)
        return events

    def report(self, m, engine, pgm, trace_path=""):
        """With --pp_timeline: each stage's timeline, its peak of held micro-batches and its idle
        fraction, beside the textbook: AFAB holds all m, 1F1B at most pp_size - pp_rank; both
        idle (p - 1) / (m + p - 1). With a trace path, rank 0 also writes its pipeline's step as
        a Chrome trace, one track per stage (chrome://tracing and ui.perfetto.dev open it;
        tools/plot_timeline.py draws it)."""
        end, p, r = time.time_ns(), pgm.pp_size, pgm.pp_rank
        expected_peak = m if engine == "afab" else min(p - r, m)
        log(
            f"pp stage {r} {engine}: {' '.join(self.timeline)} | held at most "
            f"{self.peak_in_flight} micro-batches (expected {expected_peak}) | bubble "
            f"{self.bubble():.2f} (textbook {(p - 1) / (m + p - 1):.2f})",
            all_ranks=True,
        )
        if trace_path:
            stages = [None] * p
            dist.all_gather_object(stages, self.trace_events(r, end), group=pgm.pp_group)
            if dist.get_rank() == 0:
                info = {"engine": engine, "pp_size": p, "micro_batches": m}
                write_trace(trace_path, stages, info)
                log(f"pp timeline of this step: {trace_path}")


def write_trace(path, stages, info):
    """The stages' events as one Chrome trace: a named track per stage, in order, from time 0."""
    events = [event for stage in stages for event in stage]
    origin = min(event["ts"] for event in events)
    for event in events:
        event["ts"] -= origin
    for s in range(len(stages)):
        events.append(
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": s, "args": {"name": f"stage {s}"}}
        )
        events.append(
            {"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": s, "args": {"sort_index": s}}
        )
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as file:
        json.dump({"traceEvents": events, "otherData": info}, file)


def span(name, category, start, end, stage, **args):
    """A complete ("X") event of the Chrome trace format: nanoseconds in, whole microseconds
    out, so that spans that touch still touch."""
    start, end = start // 1000, end // 1000
    return dict(
        name=name, cat=category, ph="X", ts=start, dur=end - start, pid=0, tid=stage, args=args
    )


def train_step_afab(model, micro_batches, loss_fn, shape, pgm, device, dtype, schedule):
    """All forward, then all backward. Every stage holds the activations of every micro-batch
    until its backward. Returns the step's loss on the last stage (zero on the others)."""
    held, total = [], torch.zeros((), device=device)
    first, last = pgm.pp_is_first_stage, pgm.pp_is_last_stage
    for k, (inputs, targets) in enumerate(micro_batches):
        with schedule.blocked("receive", not first):
            x = inputs if first else recv_forward(shape, pgm, device)
        with (
            schedule.run("F", k),
            torch.autocast(device.type, dtype, enabled=dtype != torch.float32),
        ):
            y = model(x)
            if pgm.pp_is_last_stage:
                # Divided by the number of micro-batches, as in step 3: the gradients are then
                # those of one process with the same accumulation, not m times larger.
                y = loss_fn(y, targets) / len(micro_batches)
                total += y.detach()
        with schedule.blocked("send", not last):
            send_forward(y, pgm)
        held.append((x, y))
    for k, (x, y) in enumerate(held):
        # Data-parallel gradients are averaged once, during the step's last backward.
        model.require_backward_grad_sync = k == len(held) - 1
        with schedule.blocked("receive", not last):
            grad = recv_backward(shape, pgm, device)
        with schedule.run("B", k):
            torch.autograd.backward(y, grad_tensors=grad)
        with schedule.blocked("send", not first):
            send_backward(x.grad, pgm)
    return total


def train_step_1f1b(model, micro_batches, loss_fn, shape, pgm, device, dtype, schedule):
    """One forward, one backward, the communication overlapped with the computation. Returns the
    step's loss on the last stage (zero elsewhere)."""
    m, first, last = len(micro_batches), pgm.pp_is_first_stage, pgm.pp_is_last_stage
    # Stage r runs pp_size - r - 1 forwards before its first backward: the micro-batches that
    # must be on their way for the last stage to start its first backward right after its first
    # forward. Never more than there are micro-batches.
    warmup = min(pgm.pp_size - pgm.pp_rank - 1, m)
    held, total, backwards = deque(), torch.zeros((), device=device), 0
    # The next micro-batch's input is received in the background: its receive is posted before
    # the current forward, so it arrives while this stage computes.
    next_input = None if first else Recv(shape, pgm.pp_prev_rank, device)
    # Sends do not block either: the stage computes while its output travels. The previous send
    # each way is waited for before the next one starts (it is normally done by then), so at most
    # one copy per direction is in flight, and all are done when the step returns.
    # Two neighbours post the messages between them in the same order (NCCL carries them out in
    # the order posted, and a receive facing a receive would wait forever): a gradient's receive
    # is posted when the backward needs it, after the send of the forward before it.
    sending = {"forward": None, "backward": None}

    def send(direction, tensor, peer):
        with schedule.blocked("send"):
            if sending[direction] is not None:
                sending[direction].wait()
            sending[direction] = Send(tensor, peer)

    def forward(k):
        nonlocal next_input
        inputs, targets = micro_batches[k]
        x = None
        if not first:
            with schedule.blocked("receive"):
                x = next_input.wait().requires_grad_()
            next_input = Recv(shape, pgm.pp_prev_rank, device) if k + 1 < m else None
        with (
            schedule.run("F", k),
            torch.autocast(device.type, dtype, enabled=dtype != torch.float32),
        ):
            y = model(inputs if first else x)
            if last:
                y = loss_fn(y, targets) / m  # as in AFAB: the mean over the micro-batches
                total.add_(y.detach())
        if not last:
            send("forward", y.detach().float(), pgm.pp_next_rank)  # activations travel in fp32
        held.append((k, x, y))

    def backward():
        nonlocal backwards
        k, x, y = held.popleft()  # the oldest micro-batch: its gradient comes back first
        with schedule.blocked("receive", not last):
            grad = None if last else Recv(shape, pgm.pp_next_rank, device).wait()
        model.require_backward_grad_sync = backwards == m - 1  # dp sync on the last backward
        backwards += 1
        with schedule.run("B", k):
            torch.autograd.backward(y, grad_tensors=grad)
        if not first:
            send("backward", x.grad, pgm.pp_prev_rank)

    for k in range(warmup):  # warm-up: forwards only
        forward(k)
    for k in range(warmup, m):  # steady state: one forward, one backward
        forward(k)
        backward()
    for _ in range(warmup):  # cool-down: the backwards left
        backward()
    with schedule.blocked("send", any(sending.values())):
        for last_send in sending.values():
            if last_send is not None:
                last_send.wait()
    return total


def clip_grad_norm(model, max_norm, pgm, tied):
    """Clip by the whole model's gradient norm: each stage's squares (already summed over its
    tensor-parallel group) are summed over the stages. A tied embedding counts once, as on one
    device: the last stage's copy is left out of the squares, but clipped by the same factor."""
    _, squares = grad_squares(tied.counted, pgm.tp_group)
    dist.all_reduce(squares, group=pgm.pp_group)
    total_norm = squares.sqrt()
    params = [p for p in model.parameters() if p.grad is not None]
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm)
    return total_norm
