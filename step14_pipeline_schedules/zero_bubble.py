"""The backward split in two, for zero-bubble schedules: B, the gradient of the stage's input
(what the stage before waits for), and W, the gradients of the weights (what nobody waits for
until the optimizer step).

A linear layer's backward is two matmuls of the same size: grad_x = grad_y W (B) and
grad_W = grad_y^T x (W). `Linear` computes the first at once and, while `deferred` collects,
keeps what the second needs (x and grad_y, no copy) and hands it over as a closure: the schedule
runs it later, in what would have been idle time. The embedding's lookup (`Lookup`) defers its
whole backward, a scatter-add of grad_y into the table's rows; a norm's weight gradient is a sum
over the tokens, cheap, so `Hold` lets B compute it and only holds it back. A W ends by handing
each gradient to autograd (`torch.autograd.backward` on the weight), which adds it to `.grad` and
runs the parameter's hooks: the data-parallel buckets fill in W, as they filled in backward.

Outside `deferred` the three compute both gradients in backward, as autograd does: the same
numbers, so 1F1B and ZB-H1 give bit-identical gradients. The collectives of tensor, sequence and
context parallelism act on activations, so they stay in B (the norm weights' sum over tp under
sequence parallelism too: B computes the gradient and sums it, W hands it over).
"""

# B micro-batch, T tokens, D in features, F out features, V vocab (rows of this rank's table)

from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from model import RMSNorm
from tensor_parallel import VocabParallelEmbedding

_pending = None  # while `deferred` collects: the list the weight gradients' closures go to


@contextmanager
def deferred(into):
    """Within it, the backward of `Linear`, `Lookup` and `Hold` computes no weight gradient: each
    appends to `into` a closure that computes it and hands it to autograd."""
    global _pending
    assert _pending is None, "one backward defers at a time"
    _pending = into
    try:
        yield into
    finally:
        _pending = None


def weight_gradients(closures):
    """W: run the deferred closures of one backward, in the order B made them."""
    for closure in closures:
        closure()


def hand_over(weight, compute):
    """Give the weight its gradient now, or, while `deferred` collects, later: a closure."""
    if _pending is None:
        torch.autograd.backward(weight, compute())
    else:
        _pending.append(lambda: torch.autograd.backward(weight, compute()))


# The three take the weight twice: detached, what the forward computes with, and the parameter
# itself in a tuple, which autograd does not look into: no edge of the graph leads to the
# parameter, so B runs none of its hooks; the closure hands it its gradient.
class Linear(torch.autograd.Function):
    """y = x W^T. Under autocast F.linear computes in the autocast dtype; the backward computes
    in the dtype of the output's gradient, as autograd does, and casts each gradient to its
    input's dtype."""

    @staticmethod
    def forward(ctx, x, weight, parameter):
        ctx.save_for_backward(x, weight)
        (ctx.parameter,) = parameter
        return F.linear(x, weight)  # (.., D) -> (.., F)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        dtype = grad.dtype

        def grad_weight():  # W: (F, B*T) @ (B*T, D), as autograd's mm backward computes it
            g, inputs = grad.flatten(0, -2), x.flatten(0, -2).to(dtype)
            return (g.t() @ inputs).to(weight.dtype)

        hand_over(ctx.parameter, grad_weight)
        return (grad @ weight.to(dtype)).to(x.dtype), None, None  # B: (.., F) @ (F, D)


def linear(x, weight):
    return Linear.apply(x, weight.detach(), (weight,))


class Lookup(torch.autograd.Function):
    """F.embedding: no gradient for the ids; the table's, a scatter-add, deferred whole."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx, parameter):
        ctx.save_for_backward(ids)
        ctx.rows, ctx.padding_idx, (ctx.parameter,) = weight.shape[0], padding_idx, parameter
        return F.embedding(ids, weight, padding_idx)  # (B, T) -> (B, T, D)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        padding = -1 if ctx.padding_idx is None else ctx.padding_idx

        def grad_weight():  # autograd's own: the rows' sums in (V, D), the pad row left at 0
            return torch.ops.aten.embedding_backward(grad, ids, ctx.rows, padding, False, False)

        hand_over(ctx.parameter, grad_weight)
        return None, None, None, None


def lookup(ids, weight, padding_idx=None):
    # The ids need no gradient: the detached weight asks for one, so that backward reaches here.
    return Lookup.apply(ids, weight.detach().requires_grad_(), padding_idx, (weight,))


class Hold(torch.autograd.Function):
    """Identity on a weight (detached, requiring a gradient of its own) whose gradient B
    computes: it reaches the parameter in W."""

    @staticmethod
    def forward(ctx, weight, parameter):
        (ctx.parameter,) = parameter
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        hand_over(ctx.parameter, lambda: grad)
        return None, None


def held_norm_forward(forward, norm, x):
    """The norm's own forward (`forward`: sequence parallelism's, or the model's), its weight
    through `Hold` for this call."""
    weight = norm._parameters["weight"]
    norm._parameters["weight"] = Hold.apply(weight.detach().requires_grad_(), (weight,))
    try:
        return forward(x)
    finally:
        norm._parameters["weight"] = weight


def apply_zero_bubble(model):
    """Every module with a weight defers its weight gradient when the schedule asks: the linear
    layers (lm_head too) and the embedding compute it in W, the norms hand it over in W."""
    for module in model.modules():
        if getattr(module, "linear", None) is F.linear:  # the parallel linears, or any so built
            module.linear = linear
        elif isinstance(module, VocabParallelEmbedding):
            module.lookup = lookup
        elif isinstance(module, RMSNorm):  # around its forward (sequence parallelism's, if on)
            module.forward = partial(held_norm_forward, module.forward, module)
    dense = [m for m in model.modules() if isinstance(m, nn.Linear | nn.Embedding)]
    assert all(getattr(m, "linear", None) is linear for m in dense), (
        "every weight is in a layer that can defer its gradient"
    )
    return model
