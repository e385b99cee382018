"""One memory table for the whole course: the bytes each rank holds, measured, beside the formula.

    python tools/memory_table.py                    # the tiny model, one layout per step 3-11
    python tools/memory_table.py --steps 4,10 --num_hidden_layers 4 --hidden_size 64 \\
        --intermediate_size 128 --num_attention_heads 4 --num_key_value_heads 2 --seq_len 32

For one layout of each step 3 to 11, the ranks are started here (gloo, forked) and each builds the
model, its wrappers and AdamW from that step's own modules, the way the step's train.py wires them,
then trains one step on random tokens. Each rank measures:

- parameters: the bytes of its parameters' storages;
- gradients: of the gradients the optimizer reads, after the step's synchronisation (the fp32
  buckets from step 6 on, each counted once);
- optimizer: AdamW's two moments, after the optimizer step (AdamW creates them at the first);
- activations: the bytes that autograd saves for backward (`saved_tensors_hooks`, each storage
  once, parameters left out) in one micro-batch's forward, the loss included; and the most it held
  at once during the step, which the pipeline schedules multiply.

Every figure is printed beside the formula it follows, computed from the single-device model's
shapes alone, and `tests/test_foundation_tools.py` holds the two together.
"""

# B micro-batch rows, T tokens, D hidden, V vocab

import argparse
import gc
import json
import os
import re
import sys
import tempfile
import textwrap
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from steps import STEPS, step_modules

ROOT = Path(__file__).resolve().parents[1]
STEP_MODULES = step_modules(ROOT)
OVERRIDES = [
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
]
MOMENTS = ["exp_avg", "exp_avg_sq"]


@dataclass(frozen=True)
class Layout:
    step: str
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    engine: str = "afab"  # the pipeline schedule, from step 7 on
    micro_batches: int = 1  # per step: a pipeline needs several to keep its stages busy

    @property
    def number(self):
        return int(re.match(r"step(\d+)_", self.step)[1])

    @property
    def world(self):
        return self.tp * self.pp * self.dp * self.cp

    def __str__(self):
        axes = [f"{a} {getattr(self, a)}" for a in ["dp", "pp", "cp", "tp"] if getattr(self, a) > 1]
        text = " x ".join(axes) or "1 process"
        if self.pp > 1:
            text += f", {self.engine.upper()}, m {self.micro_batches}"
        return text


# One layout per step (tools/steps.py's manifest), at most 4 ranks: what the step adds, no more.
LAYOUTS = {
    step.number: Layout(step.folder, **step.memory) for step in STEPS if step.memory is not None
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", default=",".join(map(str, LAYOUTS)), help="which, e.g. 4,10")
    parser.add_argument("--model_name", default="tiny", help="a config in assets/configs")
    for name in OVERRIDES:
        parser.add_argument(f"--{name}", type=int, help="override the config's value")
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--micro_batch_size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--json", metavar="PATH", help="also write every rank's figures there")
    args = parser.parse_args(argv)
    try:
        args.steps = [int(s) for s in args.steps.split(",")]
    except ValueError:
        parser.error(f"--steps {args.steps}: give step numbers, e.g. 4,10")
    unknown = [s for s in args.steps if s not in LAYOUTS]
    if unknown:
        parser.error(f"--steps: no layout for step {unknown[0]}; choose from 3 to 11")
    for name in ["seq_len", "micro_batch_size"]:
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    return args


def load_config(args):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(ROOT / "assets" / "configs" / args.model_name)
    for key in OVERRIDES:
        if getattr(args, key) is not None:
            setattr(config, key, getattr(args, key))
    config.head_dim = config.hidden_size // config.num_attention_heads
    return config


def use_step(step):
    """Make `import model`, `import tensor_parallel`, ... find step folder `step`'s modules."""
    for module in STEP_MODULES:
        sys.modules.pop(module, None)
    sys.path.insert(0, str(ROOT / step))


### begin Saved tensors
class SavedTensors:
    """The bytes autograd saves for backward while this is active: each storage counted once
    however many tensors (views, or the same input of q, k and v) are saved from it, parameters
    left out (they are held anyway). `live`: held now; `peak`: the most held at once. A saved
    tensor is let go when backward has used it, and its count goes with it."""

    def __init__(self, params):
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.held = {}  # storage address: [tensors saved from it, its bytes]
        self.live = self.peak = 0
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        if address in self.params or storage.nbytes() == 0:
            return tensor
        entry = self.held.setdefault(address, [0, storage.nbytes()])
        if entry[0] == 0:
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        box = Box(tensor.detach())  # the same storage, without the graph (that would hold itself)
        weakref.finalize(box, self.release, address)
        return box

    @staticmethod
    def unpack(packed):
        return packed.tensor if isinstance(packed, Box) else packed

    def release(self, address):
        entry = self.held[address]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.held[address]

    def wait_for_release(self, after, timeout=10.0):
        """Check that nothing saved outlives its graph. The graph can outlive its last Python
        reference for a moment: a gloo collective's work, finished, still holds the tensor it
        reduced, which may be an output of the graph, until gloo's thread lets it go."""
        deadline = time.monotonic() + timeout
        while self.live and time.monotonic() < deadline:
            gc.collect()  # a custom autograd Function's context can sit in a reference cycle
            time.sleep(0.01)
        assert self.live == 0, f"{self.live} bytes still held {timeout} s after {after}"

    def __enter__(self):
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


class Box:
    """A saved tensor, as autograd holds it: freed with it."""

    def __init__(self, tensor):
        self.tensor = tensor


### end Saved tensors
def storage_bytes(tensors):
    """The bytes of the distinct storages under `tensors` (views of one buffer count once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


### begin One rank
def build(layout, config, seed, pgm):
    """The model as the step's train.py builds it: on the meta device, the step's swaps, then
    this rank's weights."""
    from model import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
        if layout.number >= 4:
            from tensor_parallel import apply_tensor_parallel

            apply_tensor_parallel(model, pgm.tp_group)
        if layout.number >= 11 and layout.cp > 1:
            from context_parallel import apply_context_parallel

            apply_context_parallel(model, pgm.cp_group)
        if layout.number >= 7:
            from pipeline_parallel import keep_stage

            keep_stage(model, pgm)
    model.to_empty(device="cpu")
    if layout.pp == 1:
        model.tie_weights()
    model.init_weights(seed)
    return model


def wrap(layout, model, pgm):
    """What the step's train.py trains: (the module the schedule calls, the tied embedding)."""
    if layout.number < 5:
        return model, None
    if layout.number < 7:
        import data_parallel

        naive = layout.number == 5  # step 6 replaced it by the buckets
        wrapper = data_parallel.DataParallelNaive if naive else data_parallel.DataParallelBucket
        return wrapper(model, pgm.dp_group), None
    from pipeline_parallel import PipelineParallel, TiedEmbeddings

    stage, tied = PipelineParallel(model), TiedEmbeddings(model, pgm)
    if layout.number < 10:
        from data_parallel import DataParallelBucket

        return DataParallelBucket(stage, pgm.dp_group), tied
    from zero import DataParallelZero1

    axes = ("dp", "cp") if layout.number >= 11 else ("dp",)
    return DataParallelZero1(stage, pgm, axes, tied_weight=tied.weight), tied


def loss_function(layout, pgm):
    if layout.number < 4:  # step 3's: the whole vocabulary on one rank
        return lambda logits, targets: F.cross_entropy(
            logits.flatten(0, 1).float(), targets.flatten()
        )
    from tensor_parallel import vocab_parallel_cross_entropy

    return lambda logits, targets: vocab_parallel_cross_entropy(logits, targets, pgm.tp_group)


def micro_batches(layout, config, args, pgm):
    """Random tokens: `micro_batches` of (B, T) inputs and targets, this rank's chunks under cp."""
    generator = torch.Generator().manual_seed(args.seed + pgm.dp_rank)
    rows = layout.micro_batches * args.micro_batch_size
    tokens = torch.randint(0, config.vocab_size, (rows, args.seq_len + 1), generator=generator)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if layout.cp > 1:
        from context_parallel import split_sequence

        inputs, targets = (split_sequence(x, pgm.cp_rank, pgm.cp_size) for x in (inputs, targets))
    # Each micro-batch a tensor of its own, as the data loader gives: a view would keep the whole
    # batch's storage alive in the embedding's saved ids.
    chunks = (x.chunk(layout.micro_batches) for x in (inputs, targets))
    return [(x.contiguous(), y.contiguous()) for x, y in zip(*chunks, strict=True)]


def forward_bytes(layout, model, batch, loss_fn, pgm, shape):
    """The bytes saved for backward by one micro-batch's forward through this rank's part of the
    model, the loss included where this rank computes it. A stage after the first gets random
    activations of the shape its neighbour would send."""
    params = list(model.parameters())
    inputs, targets = batch
    with SavedTensors(params) as saved:
        if layout.number < 7:
            out = loss_fn(model(inputs), targets)
        else:
            x = inputs if pgm.pp_is_first_stage else torch.randn(shape, requires_grad=True)
            out = model(x)
            if pgm.pp_is_last_stage:
                out = loss_fn(out, targets)
        measured = saved.live
    del out
    saved.wait_for_release("the graph was dropped")
    return measured


def train_step(layout, model, tied, batches, loss_fn, pgm, shape):
    """One training step as the step's train.py runs it, up to the optimizer; returns the most
    bytes saved for backward at once, and the micro-batches the schedule held at most."""
    params = list(model.parameters())
    m = len(batches)
    with SavedTensors(params) as saved:
        if layout.number < 7:
            for i, (inputs, targets) in enumerate(batches):
                model.require_backward_grad_sync = i == m - 1
                loss = loss_fn(model(inputs), targets) / m
                loss.backward()
            held = 1
        else:
            import pipeline_parallel as pipeline
            from pipeline_timeline import Timeline

            actions = pipeline.SCHEDULES[layout.engine](pgm.pp_size, m)[pgm.pp_rank]
            timeline, stages = Timeline(), [pipeline.Stage(model, pgm)]
            schedule = (actions, stages, batches, loss_fn, shape, torch.device("cpu"))
            pipeline.run_schedule(*schedule, torch.float32, timeline)
            held = timeline.peak_in_flight
    if layout.number >= 5:
        model.finish_gradient_synchronization()
    if tied is not None and layout.number >= 10:
        model.sum_tied_gradients(tied)
    elif tied is not None:
        tied.sum_gradients()
    saved.wait_for_release("the step's backward")
    return saved.peak, held


def measure(rank, world, layout, config, args):
    """This rank's figures, in a process group of `world` gloo ranks and with `layout.step`'s
    modules importable."""
    from process_group_manager import ProcessGroupManager

    sizes = {"tp_size": layout.tp, "pp_size": layout.pp, "dp_size": layout.dp}
    if layout.number >= 11:
        sizes["cp_size"] = layout.cp
    pgm = ProcessGroupManager(**sizes)
    torch.manual_seed(args.seed)
    model = build(layout, config, args.seed, pgm)
    trained, tied = wrap(layout, model, pgm)
    params = [p for p in model.parameters() if p.requires_grad]
    pieces = trained.shard(params) if layout.number >= 10 else params
    optimizer = torch.optim.AdamW(pieces, lr=1e-3, betas=(0.9, 0.95), fused=True)
    loss_fn = loss_function(layout, pgm)
    batches = micro_batches(layout, config, args, pgm)
    shape = (args.micro_batch_size, args.seq_len // layout.cp, config.hidden_size)
    per_micro_batch = forward_bytes(layout, trained, batches[0], loss_fn, pgm, shape)
    peak, held = train_step(layout, trained, tied, batches, loss_fn, pgm, shape)
    grads = [p.grad for p in params if p.grad is not None]
    grads += [p.main_grad for p in params if hasattr(p, "main_grad")]
    grad_bytes = storage_bytes(grads)
    optimizer.step()
    if layout.number >= 10:
        trained.all_gather_parameters()
    moments = [s[k] for s in optimizer.state.values() for k in MOMENTS]
    return {
        "rank": rank,
        "coords": {a: getattr(pgm, f"{a}_rank", 0) for a in ["dp", "pp", "cp", "tp"]},
        "parameters": storage_bytes(model.parameters()),
        "gradients": grad_bytes,
        "optimizer": sum(t.numel() * t.element_size() for t in moments),
        "activations": per_micro_batch,
        "peak_activations": peak,
        "held": held,
    }


### end One rank
### begin Ranks
def _rank(rank, world, layout, config, args, store_path, results):
    use_step(layout.step)
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    figures = measure(rank, world, layout, config, args)
    dist.barrier()  # no rank tears its connections down while a peer still uses them
    dist.destroy_process_group()
    results.put(figures)


def run_layout(layout, config, args):
    """Every rank's figures for one layout, from `layout.world` forked gloo processes."""
    context = mp.get_context("fork")
    results = context.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.start_processes(
            _rank,
            (layout.world, layout, config, args, store, results),
            nprocs=layout.world,
            start_method="fork",
        )
    figures = [results.get() for _ in range(layout.world)]
    return sorted(figures, key=lambda f: f["rank"])


### end Ranks
### begin Formulas
SUBSCRIPT = str.maketrans("0123456789", "₀₁₂₃₄₅₆₇₈₉")
ACTIVATION_TOLERANCE = 0.005  # relative: which tensors a kernel saves may change with torch


def stage_layer_count(num_layers, pp_size, pp_rank):
    """Consecutive stages, the first ones taking one more layer when pp_size does not divide."""
    per_stage, extra = divmod(num_layers, pp_size)
    return per_stage + (pp_rank < extra)


class Shapes:
    """The sizes the formulas are written in: the model's and one micro-batch's (B rows of T
    tokens). Everything is fp32: 4 bytes a number."""

    def __init__(self, config, args):
        self.B, self.T = args.micro_batch_size, args.seq_len
        self.D, self.F, self.V = config.hidden_size, config.intermediate_size, config.vocab_size
        self.H, self.K = config.num_attention_heads, config.num_key_value_heads
        self.d, self.L = config.head_dim, config.num_hidden_layers
        self.tied = config.tie_word_embeddings

    def parameters(self, pp_size=1, pp_rank=0):
        """(M, N) of stage pp_rank on one device: M in matrices (the embedding, the projections,
        lm_head: what tensor parallelism splits), N in RMSNorm weights (whole on every tp rank)."""
        D, F, H, K, d = self.D, self.F, self.H, self.K, self.d
        layers = stage_layer_count(self.L, pp_size, pp_rank)
        first, last = pp_rank == 0, pp_rank == pp_size - 1
        matrices = layers * (2 * D * H * d + 2 * D * K * d + 3 * D * F)
        # Untied: the embedding and lm_head, V x D each; tied on one stage: one matrix for both.
        matrices += self.V * D * (first + last - (self.tied and pp_size == 1))
        return matrices, layers * 2 * D + D * last

    def activations(self, cp_size=1):
        """The bytes one micro-batch's forward saves for backward, by part, for T / cp_size tokens
        a row: a and s per decoder layer (s is what tp splits), e the embedding's, h + z the last
        stage's (z: the loss's copy of the logits, split by tp); e3 and h3 in step 3."""
        B, T, D, F, H, K, d = self.B, self.T // cp_size, self.D, self.F, self.H, self.K, self.d
        BT = B * T
        return {
            # Each RMSNorm: its input, 1/rms and normalised input; the linear after it: the
            # norm's output (3BTD + BT floats, twice); RoPE's cos and sin (T x d each).
            "r": 4 * (6 * BT * D + 2 * BT + 2 * T * d),
            # Attention: q and its output (BT H d each), k and v (BT K d each), the log-sum-exp
            # (BT H); the MLP: gate and up's outputs, silu(gate), their product (BT F each).
            "s": 4 * BT * ((2 * H + 2 * K) * d + H + 4 * F),
            "e": 9 * BT,  # the token ids (int64) and the mask of ids elsewhere (bool)
            # The final norm (2BTD + BT floats), lm_head's input (BTD floats); the loss's target
            # index (int64), mask (bool) and sum of exponentials (float), per token.
            "h": 4 * (3 * BT * D + BT) + 13 * BT,
            "z": 4 * BT * self.V,  # the exponentials: the loss keeps no other copy of the logits
            "e3": 8 * BT,  # nn.Embedding: the ids only
            "h3": 4 * (3 * BT * D + BT) + 8 * BT + 4,  # the targets, and a scalar: total weight
        }


def shard_group_size(layout):
    """The ranks that share (ZeRO) the optimizer state: dp from step 10, dp x cp in step 11."""
    if layout.number < 10:
        return 1
    return layout.dp * (layout.cp if layout.number >= 11 else 1)


def expected(layout, shapes, pp_rank):
    """{quantity: (formula, bytes, tolerance in bytes)} for a rank of stage pp_rank."""
    tp, pp, cp, m = layout.tp, layout.pp, layout.cp, layout.micro_batches
    M, N = shapes.parameters(pp, pp_rank)
    sub = str(pp_rank).translate(SUBSCRIPT) if pp > 1 else ""
    by_tp = f"/{tp}" if tp > 1 else ""
    weights = 4 * (M // tp + N)
    text = f"4(M{sub}{by_tp} + N{sub})"
    g = shard_group_size(layout)
    # ZeRO pads each bucket to a multiple of g elements (a bucket holds at most 25 MiB).
    buckets = -(-weights // (25 * 2**20)) + 1
    sharded = "8" + text[1:] + (f"/{g}" if g > 1 else "")
    # A rank's shard of a bucket differs from 1/g of the bucket by under one element.
    optimizer = (sharded, 2 * weights / g, 8 * (g > 1) * buckets)
    figures = {
        "parameters": (text, weights, 0),
        "gradients": (text, weights, 4 * (g - 1) * buckets),
        "optimizer": optimizer,
    }
    parts = shapes.activations(cp)
    layers = stage_layer_count(shapes.L, pp, pp_rank)
    split = parts["s"] // tp
    layer = f"r + s{by_tp}"
    terms = [f"{layers}({layer})" if layers > 1 else layer]
    value = layers * (parts["r"] + split)
    step3 = layout.number < 4
    if pp_rank == 0:
        terms.append("e′" if step3 else "e")
        value += parts["e3" if step3 else "e"]
    if pp_rank == pp - 1:
        # Step 3's F.cross_entropy keeps one copy of the logits too, the log-softmax.
        terms.append("h′ + z" if step3 else f"h + z{by_tp}")
        value += parts["h3"] + parts["z"] if step3 else parts["h"] + parts["z"] // tp
    text = " + ".join(terms)
    if cp > 1:
        text = f"[{text}]/{cp}"  # every part is per token: T/cp tokens, 1/cp of the bytes
    figures["activations"] = (text, value, ACTIVATION_TOLERANCE * value)
    held = 1 if pp == 1 else m if layout.engine == "afab" else min(pp - pp_rank, m)
    peak_text = text if held == 1 else f"{held} × {text if '+' not in text else f'({text})'}"
    figures["peak_activations"] = (peak_text, held * value, held * ACTIVATION_TOLERANCE * value)
    rule = "1" if pp == 1 else "m" if layout.engine == "afab" else "pp - pp_rank"
    figures["held"] = (rule, held, 0)
    return figures


### end Formulas
### begin Table
QUANTITIES = ["parameters", "gradients", "optimizer", "activations", "peak_activations"]
HEADERS = ["parameters", "gradients", "AdamW moments", "activations, 1 micro-batch", "held at most"]


def rows_of(layout, figures, shapes):
    """Ranks with the same figures share a row; each figure with its formula and a verdict."""
    groups = {}
    for f in figures:
        groups.setdefault(tuple(f[q] for q in [*QUANTITIES, "held"]), []).append(f)
    rows = []
    for group in groups.values():
        pp_rank = group[0]["coords"]["pp"]
        want = expected(layout, shapes, pp_rank)
        cells, ok = {}, True
        for quantity in [*QUANTITIES, "held"]:
            text, value, tolerance = want[quantity]
            got = group[0][quantity]
            agrees = abs(got - value) <= tolerance
            ok &= agrees
            sign = "=" if got == value else "≈" if agrees else "≠"
            cells[quantity] = f"{got:,} {sign} {text}"
            if got != value:
                cells[quantity] += f" = {value:,.0f}"
        ranks = ", ".join(str(f["rank"]) for f in group)
        stage = f" (pp {pp_rank})" if layout.pp > 1 else ""
        rows.append({"layout": layout, "ranks": ranks + stage, "cells": cells, "ok": ok,
                     "figures": group, "expected": want})  # fmt: skip
    return rows


def table(rows):
    lines = ["| step | layout | ranks | " + " | ".join(HEADERS) + " |"]
    lines.append("| --- | --- | --- |" + " ---: |" * len(HEADERS))
    for row in rows:
        cells = [row["cells"][q] for q in QUANTITIES]
        layout = row["layout"]
        lines.append(f"| {layout.number} | {layout} | {row['ranks']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def legend(shapes, layouts, args):
    """The symbols of the formulas, with their values for this run."""
    s, parts = shapes, shapes.activations()
    M, N = s.parameters()
    lines = [
        f"B = {s.B} rows of T = {s.T} tokens per micro-batch (T/cp on a cp rank); D = {s.D}, "
        f"F = {s.F}, V = {s.V}, H = {s.H} and K = {s.K} heads of d = {s.d}, L = {s.L} layers; "
        "fp32, 4 bytes a number.",
        f"M = {M:,} parameters in matrices (embedding, projections, lm_head: split by tp), "
        f"N = {N:,} in RMSNorm weights (whole on every tp rank).",
    ]
    for pp in sorted({layout.pp for layout in layouts if layout.pp > 1}):
        stages = [s.parameters(pp, r) for r in range(pp)]
        text = ", ".join(
            f"M{str(r).translate(SUBSCRIPT)} = {m:,}, N{str(r).translate(SUBSCRIPT)} = {n:,}"
            for r, (m, n) in enumerate(stages)
        )
        lines.append(f"pp {pp}, stage i's share: {text}.")
    lines.append(
        f"Saved for backward, bytes: r = {parts['r']:,} and s = {parts['s']:,} per layer (r "
        f"replicated on the tp ranks, s split), e = {parts['e']:,} (embedding), h = "
        f"{parts['h']:,} and z = {parts['z']:,} (final norm, lm_head, loss; z: the loss's one copy "
        f"of the logits, split by tp); step 3: e′ = {parts['e3']:,}, h′ = {parts['h3']:,}."
    )
    lines.append(
        "Held at most: the most bytes saved for backward at once in the step, 1 micro-batch's "
        "without a pipeline, m's with AFAB, (pp - pp_rank)'s with 1F1B."
    )
    # Lines break between the symbols' definitions, never inside "D = 256".
    wrapped = [textwrap.wrap(text.replace(" = ", "\xa0=\xa0"), 96) for text in lines]
    return "\n".join(line.replace("\xa0", " ") for text in wrapped for line in text)


### end Table
def check_layouts(layouts, config, args):
    """Refuse, with the numbers, a model or micro-batch that a layout cannot split."""
    names = ["num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"]
    sizes = {name: getattr(config, name) for name in names}
    for layout in layouts:
        where = f"step {layout.number}'s layout ({layout})"
        for name, size in sizes.items():
            if size % layout.tp:
                raise ValueError(f"{where}: tp_size={layout.tp} does not divide {name}={size}")
        if layout.pp > config.num_hidden_layers:
            raise ValueError(
                f"{where}: pp_size={layout.pp} needs at least {layout.pp} layers, the model has "
                f"num_hidden_layers={config.num_hidden_layers}"
            )
        if args.seq_len % (2 * layout.cp):
            raise ValueError(
                f"{where}: seq_len={args.seq_len} is not a multiple of 2 * cp_size = "
                f"{2 * layout.cp}"
            )
    if config.hidden_size % config.num_attention_heads:
        raise ValueError(
            f"num_attention_heads={config.num_attention_heads} does not divide "
            f"hidden_size={config.hidden_size}"
        )


def main(argv=None):
    args = parse_args(argv)
    config = load_config(args)
    layouts = [LAYOUTS[number] for number in args.steps]
    try:
        check_layouts(layouts, config, args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    shapes, rows = Shapes(config, args), []
    for layout in layouts:
        rows += rows_of(layout, run_layout(layout, config, args), shapes)
        print(f"step {layout.number} ({layout}): measured", file=sys.stderr, flush=True)
    heading = (
        f"Bytes per rank, {args.model_name} model, one training step on random tokens, "
        f"{args.micro_batch_size} x {args.seq_len} tokens per micro-batch; "
        "measured = formula (≈: within the tolerance)."
    )
    print("\n".join(textwrap.wrap(heading, 96)) + "\n")
    print(table(rows))
    print()
    print(legend(shapes, layouts, args))
    if args.json:
        records = [{"step": r["layout"].number, "layout": str(r["layout"]), "ok": r["ok"],
                    "figures": r["figures"],
                    "expected": {q: list(v) for q, v in r["expected"].items()}}
                   for r in rows]  # fmt: skip
        Path(args.json).write_text(json.dumps({"shapes": vars(shapes), "rows": records}, indent=1))
    wrong = [f"step {r['layout'].number} ranks {r['ranks']}" for r in rows if not r["ok"]]
    if wrong:
        print(f"\nDISAGREEMENT with the formulas: {'; '.join(wrong)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
