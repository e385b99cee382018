"""Pipeline parallelism: the decoder layers cut into pp_size consecutive stages, one per rank.

The first stage also owns the embedding, the last the final norm and lm_head. A micro-batch's
activations travel forward from stage to stage (point-to-point send/recv, shapes known in
advance), and their gradients travel back. The schedule decides the order: AFAB runs every
micro-batch of the step forward, then every one backward. 1F1B starts backwards as early as
possible and then alternates one forward with one backward, so a stage holds the activations of
at most pp_size - pp_rank micro-batches instead of all of them, for the same bubble. Each stage
builds only its own layers, with the same names (and so the same initial weights) as in the
single-device model.
"""

# B micro-batch, T tokens, D hidden, V vocab

import time
from collections import deque
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from tensor_parallel import grad_squares


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
    if pp_size > 1 and config.tie_word_embeddings:
        raise ValueError(
            "tie_word_embeddings=True with pp_size > 1 is not supported: the embedding and lm_head "
            "live on different stages; use an untied config or pp_size=1"
        )


def keep_stage(model, pgm):
    """Drop what this stage does not run. Call it on the meta device, before any weight exists.
    The layers kept are keyed by their global index, so their state-dict names are those of the
    single-device model."""
    layers = stage_layers(len(model.model.layers), pgm.pp_rank, pgm.pp_size)
    model.model.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in layers})
    if not pgm.pp_is_first_stage:
        model.model.embed_tokens = None
    if not pgm.pp_is_last_stage:
        model.model.norm, model.lm_head = None, None
    return model


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


def exchange(tensor, shape, peer, device):
    """Send `tensor` to `peer` and receive a tensor of `shape` from it, the two posted together:
    the neighbour does the mirror image, and two blocking sends facing each other would wait
    forever."""
    received = torch.empty(shape, device=device)
    ops = [
        dist.P2POp(dist.isend, tensor.contiguous(), peer),
        dist.P2POp(dist.irecv, received, peer),
    ]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received


def send_forward_recv_backward(y, shape, pgm, device):
    """Send this micro-batch's output, receive the gradient of the oldest one held."""
    if pgm.pp_is_last_stage:
        return None
    return exchange(y.detach().float(), shape, pgm.pp_next_rank, device)


def send_backward_recv_forward(grad, shape, pgm, device):
    """Send an input's gradient back, receive the next micro-batch's input."""
    if pgm.pp_is_first_stage:
        return None
    return exchange(grad, shape, pgm.pp_prev_rank, device).requires_grad_()


### end Communication
def forward_step(model, inputs, shape, pgm, device):
    """One micro-batch through this stage; returns (this stage's input, its output)."""
    x = inputs if pgm.pp_is_first_stage else recv_forward(shape, pgm, device)
    y = model(x)
    send_forward(y, pgm)
    return x, y


class Schedule:
    """What a stage did during one step: the order of its forwards and backwards (the timeline,
    F1 F2 B1 ...), the peak number of micro-batches whose activations it held at once, and the
    time it spent computing, the rest of the step being the bubble (waiting)."""

    def __init__(self):
        self.timeline, self.in_flight, self.peak_in_flight = [], 0, 0
        self.busy, self.start = 0.0, time.perf_counter()

    @contextmanager
    def run(self, kind, k):
        start = time.perf_counter()
        yield
        self.busy += time.perf_counter() - start
        self.timeline.append(f"{kind}{k + 1}")
        self.in_flight += 1 if kind == "F" else -1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

    def bubble(self):
        return 1.0 - self.busy / (time.perf_counter() - self.start)


def train_step_afab(model, micro_batches, loss_fn, shape, pgm, device, dtype, schedule):
    """All forward, then all backward. Every stage holds the activations of every micro-batch
    until its backward. Returns the step's loss on the last stage (zero on the others)."""
    held, total = [], torch.zeros((), device=device)
    for k, (inputs, targets) in enumerate(micro_batches):
        x = inputs if pgm.pp_is_first_stage else recv_forward(shape, pgm, device)
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
        send_forward(y, pgm)
        held.append((x, y))
    for k, (x, y) in enumerate(held):
        # Data-parallel gradients are averaged once, during the step's last backward.
        model.require_backward_grad_sync = k == len(held) - 1
        grad = recv_backward(shape, pgm, device)
        with schedule.run("B", k):
            torch.autograd.backward(y, grad_tensors=grad)
        send_backward(x.grad, pgm)
    return total


def train_step_1f1b(model, micro_batches, loss_fn, shape, pgm, device, dtype, schedule):
    """One forward, one backward. Returns the step's loss on the last stage (zero elsewhere)."""
    m = len(micro_batches)
    # Stage r runs pp_size - r - 1 forwards before its first backward: the micro-batches that
    # must be on their way for the last stage to start its first backward right after its first
    # forward. Never more than there are micro-batches.
    warmup = min(pgm.pp_size - pgm.pp_rank - 1, m)
    held, total, backwards = deque(), torch.zeros((), device=device), 0

    def forward(k, x):
        inputs, targets = micro_batches[k]
        with (
            schedule.run("F", k),
            torch.autocast(device.type, dtype, enabled=dtype != torch.float32),
        ):
            y = model(inputs if pgm.pp_is_first_stage else x)
            if pgm.pp_is_last_stage:
                y = loss_fn(y, targets) / m  # as in AFAB: the mean over the micro-batches
                total.add_(y.detach())
        held.append((k, x, y))
        return y

    def backward(grad):
        nonlocal backwards
        k, x, y = held.popleft()  # the oldest micro-batch: its gradient came back first
        model.require_backward_grad_sync = backwards == m - 1  # dp sync on the last backward
        backwards += 1
        with schedule.run("B", k):
            torch.autograd.backward(y, grad_tensors=grad)
        return None if pgm.pp_is_first_stage else x.grad

    for k in range(warmup):  # warm-up: forwards only
        send_forward(forward(k, recv_forward(shape, pgm, device)), pgm)
    x = recv_forward(shape, pgm, device) if warmup < m else None
    for k in range(warmup, m):  # steady state: one forward, one backward
        grad = send_forward_recv_backward(forward(k, x), shape, pgm, device)
        input_grad = backward(grad)
        if k == m - 1:
            send_backward(input_grad, pgm)
        else:
            x = send_backward_recv_forward(input_grad, shape, pgm, device)
    for _ in range(warmup):  # cool-down: the backwards left
        send_backward(backward(recv_backward(shape, pgm, device)), pgm)
    return total


def clip_grad_norm(model, max_norm, pgm):
    """Clip by the whole model's gradient norm: each stage's squares (already summed over its
    tensor-parallel group) are summed over the stages."""
    params, squares = grad_squares(model, pgm.tp_group)
    dist.all_reduce(squares, group=pgm.pp_group)
    total_norm = squares.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm)
    return total_norm
