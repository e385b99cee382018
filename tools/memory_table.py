"""One memory table for the whole course: the bytes each rank holds, measured, beside the formula.

    python tools/memory_table.py                    # the tiny model, one layout per step 3-15
    python tools/memory_table.py --steps 4,10 --num_hidden_layers 4 --hidden_size 64 \\
        --intermediate_size 128 --num_attention_heads 4 --num_key_value_heads 2 --seq_len 32

For one layout of each step 3 to 15, the ranks are started here (gloo, forked) and each builds the
model, its wrappers and AdamW from that step's own modules, the way the step's train.py wires them,
then trains one step on random tokens; step 15's layout trains the mixture of experts
(--moe_model_name), the others the dense model. Each rank measures:

- parameters: the bytes of its parameters' storages (ZeRO-3's: its rows; ep's: its experts);
- gradients: of the gradients the optimizer reads, after the step's synchronisation (the fp32
  buckets from step 6 on, each counted once);
- optimizer: AdamW's two moments, after the optimizer step (AdamW creates them at the first);
- activations: the bytes that autograd saves for backward (`saved_tensors_hooks`, each storage
  once, weights left out) in one micro-batch's forward, the loss included; and the most it held
  at once during the step, which the pipeline schedules multiply.

Every figure is printed beside the formula it follows, computed from the single-device model's
shapes alone, but for step 15's activations: the rows that a rank's experts receive are the
router's choice, counted from the step's own record of the rows per expert, then multiplied by
what each row saves. `tests/test_foundation_tools.py` holds the two together.
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
from types import SimpleNamespace

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
    ep: int = 1  # expert-parallel ranks, borrowed from dp: no ranks of their own (step 15)
    engine: str = "afab"  # the pipeline schedule, from step 7 on
    virtual_stages: int = 1  # chunks of layers per pipeline rank: the interleaved schedule's v
    micro_batches: int = 1  # per step: a pipeline needs several to keep its stages busy
    zero_stage: int = 1  # from step 10 on; 3 shards the parameters and gradients too (step 12)
    sequence_parallel: bool = False  # step 13: the tp ranks split the tokens between the regions
    moe: bool = False  # step 15: the mixture-of-experts model (--moe_model_name)

    @property
    def number(self):
        return int(re.match(r"step(\d+)_", self.step)[1])

    @property
    def world(self):
        return self.tp * self.pp * self.dp * self.cp

    def __str__(self):
        axes = [f"{a} {getattr(self, a)}" for a in ["dp", "pp", "cp", "tp"] if getattr(self, a) > 1]
        text = " x ".join(axes) or "1 process"
        if self.ep > 1:
            text += f" (ep {self.ep})"
        if self.zero_stage > 1:
            text += f", ZeRO-{self.zero_stage}"
        if self.sequence_parallel:
            text += ", sequence parallel"
        if self.pp > 1:
            chunks = f" v {self.virtual_stages}" if self.virtual_stages > 1 else ""
            text += f", {self.engine.upper()}{chunks}, m {self.micro_batches}"
        return text


# One layout per step (tools/steps.py's manifest), at most 4 ranks: what the step adds, no more.
LAYOUTS = {
    step.number: Layout(step.folder, **step.memory) for step in STEPS if step.memory is not None
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", default=",".join(map(str, LAYOUTS)), help="which, e.g. 4,10")
    parser.add_argument("--model_name", default="tiny", help="a config in assets/configs")
    parser.add_argument(
        "--moe_model_name", default="tiny-moe", help="the mixture of experts of step 15's row"
    )
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
        parser.error(
            f"--steps: no layout for step {unknown[0]}; choose from {min(LAYOUTS)} to "
            f"{max(LAYOUTS)}"
        )
    for name in ["seq_len", "micro_batch_size"]:
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    return args


def load_config(args, name):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(ROOT / "assets" / "configs" / name)
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
    tensor is let go when backward has used it, and its count goes with it. `gathered`: ZeRO-3's
    whole weights (step 12), gathered for a unit's forward and backward and freed after, at a new
    address each time: autograd saves views of them, which are weights too."""

    def __init__(self, params, gathered=()):
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.gathered = list(gathered)
        self.held = {}  # storage address: [tensors saved from it, its bytes]
        self.live = self.peak = 0
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        weights = self.params | {t.untyped_storage().data_ptr() for t in self.gathered}
        if address in weights or storage.nbytes() == 0:
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
        if layout.sequence_parallel:
            from sequence_parallel import apply_sequence_parallel

            apply_sequence_parallel(model)
        if layout.moe:
            from moe import apply_moe

            apply_moe(model, pgm, layout.sequence_parallel)
            if layout.ep > 1:
                from expert_parallel import apply_expert_parallel

                apply_expert_parallel(model, pgm)
        if layout.number >= 11 and layout.cp > 1:
            from context_parallel import apply_context_parallel

            apply_context_parallel(model, pgm.cp_group)
        if layout.number >= 7:
            from pipeline_parallel import keep_stage

            chunks = [layout.virtual_stages] if layout.number >= 14 else []
            keep_stage(model, pgm, *chunks)
        if layout.zero_stage == 3:
            from fully_sharded import shard_parameters

            shard_parameters(model, pgm, ("dp", "cp"))
    model.to_empty(device="cpu")
    if layout.pp == 1:
        model.tie_weights()
    model.init_weights(seed)
    if layout.moe:
        from moe import add_expert_bias

        add_expert_bias(model, torch.device("cpu"))
    return model


def wrap(layout, model, pgm):
    """What the step's train.py trains: (the module the schedule calls, the tied embedding, the
    group the pipeline's gradients travel on)."""
    if layout.number < 5:
        return model, None, None
    if layout.number < 7:
        import data_parallel

        naive = layout.number == 5  # step 6 replaced it by the buckets
        wrapper = data_parallel.DataParallelNaive if naive else data_parallel.DataParallelBucket
        return wrapper(model, pgm.dp_group), None, None
    import pipeline_parallel as pipeline

    if layout.number < 14:
        stage, gradients = pipeline.PipelineParallel(model), None
    else:  # each rank's chunks of layers, and a group of their own for the gradients
        L, v = model.config.num_hidden_layers, layout.virtual_stages
        chunks = pipeline.rank_chunks(L, pgm.pp_rank, pgm.pp_size, v)
        stage = pipeline.PipelineParallel(model, chunks)
        gradients = pipeline.gradient_group(pgm)
    tied = pipeline.TiedEmbeddings(model, pgm)
    if layout.number < 10:
        from data_parallel import DataParallelBucket

        return DataParallelBucket(stage, pgm.dp_group), tied, gradients
    axes = ("dp", "cp") if layout.number >= 11 else ("dp",)
    if layout.zero_stage == 3:
        from fully_sharded import FullyShardedDataParallel

        return FullyShardedDataParallel(stage, model, pgm, axes), tied, gradients
    from zero import DataParallelZero1

    return DataParallelZero1(stage, pgm, axes, tied_weight=tied.weight), tied, gradients


def gathered(model):
    """ZeRO-3's whole weights, one buffer per unit (`SavedTensors`' `gathered`)."""
    return [unit.full for unit in getattr(model, "units", [])]


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
    model (each of its chunks), the loss included where this rank computes it. A stage after the
    first gets random activations of the shape its neighbour would send."""
    params = list(model.parameters())
    inputs, targets = batch
    outputs = []
    with SavedTensors(params, gathered(model)) as saved:
        if layout.number < 7:
            outputs.append(loss_fn(model(inputs), targets))
        else:
            from pipeline_parallel import Stage

            for chunk in range(layout.virtual_stages):
                stage = Stage(model, pgm, chunk, layout.virtual_stages)
                x = inputs if stage.is_first else torch.randn(shape, requires_grad=True)
                outputs.append(stage.forward(x))
                if stage.is_last:
                    outputs[-1] = loss_fn(outputs[-1], targets)
        measured = saved.live
    del outputs
    saved.wait_for_release("the graph was dropped")
    return measured


def train_step(layout, model, wrapped, batches, loss_fn, pgm, shape):
    """One training step as the step's train.py runs it, up to the optimizer (`wrapped`: the tied
    embedding and the gradients' group, from `wrap`); returns the most bytes saved for backward
    at once, and the micro-batches the schedule held at most (chunks of them, interleaved)."""
    tied, gradients = wrapped
    params = list(model.parameters())
    m, v = len(batches), layout.virtual_stages
    with SavedTensors(params, gathered(model)) as saved:
        if layout.number < 7:
            for i, (inputs, targets) in enumerate(batches):
                model.require_backward_grad_sync = i == m - 1
                loss = loss_fn(model(inputs), targets) / m
                loss.backward()
            held = 1
        else:
            import pipeline_parallel as pipeline
            from pipeline_timeline import Timeline

            chunks, group = ([v], [gradients]) if layout.number >= 14 else ([], [])
            actions = pipeline.SCHEDULES[layout.engine](pgm.pp_size, m, *chunks)[pgm.pp_rank]
            timeline = Timeline()
            stages = [pipeline.Stage(model, pgm, c, v, *group) for c in range(v)]
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
    if layout.number >= 15:
        sizes["ep_size"] = layout.ep
    pgm = ProcessGroupManager(**sizes)
    torch.manual_seed(args.seed)
    model = build(layout, config, args.seed, pgm)
    trained, *wrapped = wrap(layout, model, pgm)
    params = [p for p in model.parameters() if p.requires_grad]
    pieces = trained.shard(params) if layout.number >= 10 else params
    optimizer = torch.optim.AdamW(pieces, lr=1e-3, betas=(0.9, 0.95), fused=True)
    if layout.moe:  # the router's losses, their coefficients the config's, as train.py sets them
        from moe import set_router_losses

        losses = SimpleNamespace(aux_loss_coef=None, z_loss_coef=0.0)
        set_router_losses(model, losses, 1 / layout.micro_batches)
    loss_fn = loss_function(layout, pgm)
    batches = micro_batches(layout, config, args, pgm)
    # A cp rank holds T/cp tokens of each row; with sequence parallelism a tp rank 1/tp of those.
    tokens = args.seq_len // layout.cp // (layout.tp if layout.sequence_parallel else 1)
    shape = (args.micro_batch_size, tokens, config.hidden_size)
    per_micro_batch = forward_bytes(layout, trained, batches[0], loss_fn, pgm, shape)
    peak, held = train_step(layout, trained, wrapped, batches, loss_fn, pgm, shape)
    grads = [p.grad for p in params if p.grad is not None]
    grads += [p.main_grad for p in params if hasattr(p, "main_grad")]
    grad_bytes = storage_bytes(grads)
    optimizer.step()
    if layout.number >= 10:
        trained.all_gather_parameters()
    moments = [s[k] for s in optimizer.state.values() for k in MOMENTS]
    figures = {
        "rank": rank,
        "coords": {a: getattr(pgm, f"{a}_rank", 0) for a in ["dp", "pp", "cp", "tp", "ep"]},
        "ep_group": getattr(pgm, "ep_group_ids", [rank]),  # the expert layout's, from its grid
        "parameters": storage_bytes(model.parameters()),
        "gradients": grad_bytes,
        "optimizer": sum(t.numel() * t.element_size() for t in moments),
        "activations": per_micro_batch,
        "peak_activations": peak,
        "held": held,
    }
    if layout.moe:  # each layer's token slots per expert, as the step records them for its log
        from moe import moe_layers

        layers = moe_layers(model)
        assert layout.micro_batches == 1 and all(len(moe.record) == 1 for moe in layers)
        figures["expert_rows"] = [moe.record[0][1].tolist() for moe in layers]
    return figures


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


def rank_layer_count(num_layers, pp_size, pp_rank, chunks=1):
    """The layers of pipeline rank pp_rank: its chunks are stages pp_rank, pp_rank + pp_size, ...
    of the pp_size x chunks stages."""
    stages = pp_size * chunks
    return sum(stage_layer_count(num_layers, stages, c * pp_size + pp_rank) for c in range(chunks))


class Shapes:
    """The sizes the formulas are written in: the model's and one micro-batch's (B rows of T
    tokens). Everything is fp32: 4 bytes a number."""

    def __init__(self, config, args):
        self.B, self.T = args.micro_batch_size, args.seq_len
        self.D, self.F, self.V = config.hidden_size, config.intermediate_size, config.vocab_size
        self.H, self.K = config.num_attention_heads, config.num_key_value_heads
        self.d, self.L = config.head_dim, config.num_hidden_layers
        self.tied = config.tie_word_embeddings
        # A mixture of experts (step 15): E experts a layer, k of them a token; E = 0: one MLP.
        self.E = getattr(config, "num_local_experts", 0) or 0
        self.k = config.num_experts_per_tok if self.E else 0

    def parameters(self, pp_size=1, pp_rank=0, chunks=1):
        """(M, N, X) of pipeline rank pp_rank (its `chunks` chunks of layers) on one device: M in
        matrices (the embedding, the projections, lm_head: what tensor parallelism splits), N in
        weights whole on every tp rank (RMSNorm's; a mixture of experts' routers), X in experts."""
        D, F, H, K, d, E = self.D, self.F, self.H, self.K, self.d, self.E
        layers = rank_layer_count(self.L, pp_size, pp_rank, chunks)
        first, last = pp_rank == 0, pp_rank == pp_size - 1
        mlp = 0 if E else 3 * D * F  # the experts' are X
        matrices = layers * (2 * D * H * d + 2 * D * K * d + mlp)
        # Untied: the embedding and lm_head, V x D each; tied on one stage: one matrix for both.
        matrices += self.V * D * (first + last - (self.tied and pp_size == 1))
        return matrices, layers * (2 * D + D * E) + D * last, layers * E * 3 * D * F

    def activations(self, cp_size=1, ep_size=1):
        """The bytes one micro-batch's forward saves for backward, by part, for T / cp_size tokens
        a row: r and s per decoder layer (s is what tp splits), e the embedding's, h + z the last
        stage's (z: the loss's copy of the logits, split by tp); e3 and h3 in step 3. Sequence
        parallelism splits r = n + c and h = n′ + c′ by their norms, n and n′. A mixture of
        experts' layer saves r + a + u, and ρ for each row its experts on this rank receive."""
        B, T, D, F, H, K, d = self.B, self.T // cp_size, self.D, self.F, self.H, self.K, self.d
        E, k, BT = self.E, self.k, B * T
        parts = {
            # Each RMSNorm: its input, 1/rms and normalised input; the linear after it: the
            # norm's output (3BTD + BT floats, twice); RoPE's cos and sin (T x d each).
            "r": 4 * (6 * BT * D + 2 * BT + 2 * T * d),
            "n": 4 * (4 * BT * D + 2 * BT),  # r's norms: what sequence parallelism splits
            # Attention: q and its output (BT H d each), k and v (BT K d each), the log-sum-exp
            # (BT H); the MLP: gate and up's outputs, silu(gate), their product (BT F each).
            "s": 4 * BT * ((2 * H + 2 * K) * d + H + 4 * F),
            "a": 4 * BT * ((2 * H + 2 * K) * d + H),  # s's attention, without the MLP
            "e": 9 * BT,  # the token ids (int64) and the mask of ids elsewhere (bool)
            # The final norm (2BTD + BT floats), lm_head's input (BTD floats); the loss's target
            # index (int64), mask (bool) and sum of exponentials (float), per token.
            "h": 4 * (3 * BT * D + BT) + 13 * BT,
            "n′": 4 * (2 * BT * D + BT),  # h's final norm
            "z": 4 * BT * self.V,  # the exponentials: the loss keeps no other copy of the logits
            "e3": 8 * BT,  # nn.Embedding: the ids only
            "h3": 4 * (3 * BT * D + BT) + 8 * BT + 4,  # the targets, and a scalar: total weight
            # The router's logits (for the z-loss's logsumexp) and probabilities (BT E floats
            # each), the logsumexp and the top k's sum (BT), the top k's probabilities and
            # weights (BT k); three int64 indices of the BT k slots (the top k, each slot's
            # token, the way back to slot order); the rows back in slot order (BT k D); the
            # balancing loss's slots per expert over T (B E).
            "u": 4 * BT * (2 * E + 2 + 2 * k + k * D) + 24 * BT * k + 4 * B * E,
            # A routed row on its expert's rank: the row, and the expert's gate and up outputs,
            # silu(gate) and their product (D + 4F floats); across ranks, two int64 indices more
            # (regrouped by expert, and back).
            "ρ": 4 * (D + 4 * F) + 16 * (ep_size > 1),
        }
        parts["c"], parts["c′"] = parts["r"] - parts["n"], parts["h"] - parts["n′"]
        return parts


def shard_group_size(layout):
    """The ranks that share (ZeRO) the optimizer state: dp from step 10, dp x cp from step 11."""
    if layout.number < 10:
        return 1
    return layout.dp * (layout.cp if layout.number >= 11 else 1)


def interleaved_order(pp_size, m, chunks, pp_rank):
    """Megatron-LM's interleaved 1F1B on rank pp_rank, as ("F" or "B", chunk): the forwards take
    the micro-batches in groups of pp_size, each group through chunk 0, 1, ...; the backwards the
    same groups, the chunks in reverse. (chunks - 1) pp_size + 2 (pp_size - pp_rank - 1)
    forwards warm up; then one forward, one backward; then the backwards left. Written out here,
    not taken from step 14's `interleaved_1f1b`: the formula side states the order on its own, so
    that a change of the step's schedule shows as a disagreement instead of moving both sides."""
    total, cycle = m * chunks, pp_size * chunks
    forwards = [("F", i % cycle // pp_size) for i in range(total)]
    backwards = [("B", chunks - 1 - i % cycle // pp_size) for i in range(total)]
    warmup = min((chunks - 1) * pp_size + 2 * (pp_size - pp_rank - 1), total)
    order = forwards[:warmup]
    for i in range(warmup, total):
        order += [forwards[i], backwards[i - warmup]]
    return order + backwards[total - warmup :]


def stage_activations(layout, parts, layers, first, last, routed=0):
    """(formula, bytes) of what one micro-batch's forward saves on layers of `layers`, the
    embedding's too where `first`, the final norm's, lm_head's and the loss's where `last`;
    `routed`: the rows this rank's experts received (a mixture of experts)."""
    tp = layout.tp
    by_tp = f"/{tp}" if tp > 1 else ""
    if layout.sequence_parallel:  # the norms see this rank's T/tp tokens, the rest all T
        layer, value = f"n{by_tp} + c + s{by_tp}", parts["n"] // tp + parts["c"] + parts["s"] // tp
    elif layout.moe:  # the experts run whole on every tp rank
        layer, value = f"r + a{by_tp} + u", parts["r"] + parts["a"] // tp + parts["u"]
    else:
        layer, value = f"r + s{by_tp}", parts["r"] + parts["s"] // tp
    terms, value = [f"{layers}({layer})" if layers > 1 else layer], layers * value
    step3 = layout.number < 4
    if first:
        terms.append("e′" if step3 else "e")
        value += parts["e3" if step3 else "e"]
    if last and step3:  # F.cross_entropy keeps one copy of the logits too, the log-softmax
        terms.append("h′ + z")
        value += parts["h3"] + parts["z"]
    elif last and layout.sequence_parallel:  # lm_head's input gathered: all T tokens
        terms.append(f"n′{by_tp} + c′ + z{by_tp}")
        value += parts["n′"] // tp + parts["c′"] + parts["z"] // tp
    elif last:
        terms.append(f"h + z{by_tp}")
        value += parts["h"] + parts["z"] // tp
    if layout.moe:  # known once the routers have chosen: the step's counts give it
        terms.append(f"{routed:,}ρ")
        value += routed * parts["ρ"]
    return " + ".join(terms), value


def interleaved_peak(layout, shapes, parts, pp_rank):
    """The interleaved order replayed, each chunk's forward adding its bytes and its backward
    taking them away: (the formula of the most held at once, its bytes, the most chunks of
    micro-batches held at once)."""
    pp, v = layout.pp, layout.virtual_stages
    chunks = []
    for c in range(v):
        stage = c * pp + pp_rank
        layers = stage_layer_count(shapes.L, pp * v, stage)
        chunks.append(stage_activations(layout, parts, layers, stage == 0, stage == pp * v - 1))
    live, most, peak, at = [0] * v, 0, 0, [0] * v
    for kind, c in interleaved_order(pp, layout.micro_batches, v, pp_rank):
        live[c] += 1 if kind == "F" else -1
        most = max(most, sum(live))
        now = sum(n * value for n, (_, value) in zip(live, chunks, strict=True))
        if now > peak:
            peak, at = now, list(live)
    text = " + ".join(f"{n} × ({chunks[c][0]})" for c, n in enumerate(at) if n)
    return text, peak, most


def expected(layout, shapes, pp_rank, routed=0):
    """{quantity: (formula, bytes, tolerance in bytes)} for a rank of stage pp_rank; `routed`:
    the rows its experts received, over the layers (step 15)."""
    tp, pp, cp, ep, m = layout.tp, layout.pp, layout.cp, layout.ep, layout.micro_batches
    M, N, X = shapes.parameters(pp, pp_rank, layout.virtual_stages)
    sub = str(pp_rank).translate(SUBSCRIPT) if pp > 1 else ""
    by_tp = f"/{tp}" if tp > 1 else ""
    experts = f"X/{ep}" if ep > 1 else "X"
    weights = 4 * (M // tp + N + X // ep)
    text = f"4(M{sub}{by_tp} + N{sub}" + (f" + {experts})" if X else ")")
    g = shard_group_size(layout)
    if layout.zero_stage == 3:  # every parameter's rows cut over the g ranks, exactly
        text += f"/{g}"
        figures = {
            "parameters": (text, weights / g, 0),
            "gradients": (text, weights / g, 0),
            "optimizer": ("8" + text[1:], 2 * weights / g, 0),
        }
    else:
        # ZeRO pads each bucket to a multiple of g elements (a bucket holds at most 25 MiB; the
        # experts' buckets, apart, cut the others' at every layer).
        buckets = -(-weights // (25 * 2**20)) + 1 + (shapes.L if X else 0)
        sharded = "8" + text[1:] + (f"/{g}" if g > 1 else "")
        moments = 2 * weights / g
        if X:  # an expert's moments shared by the ranks that hold it: edp x cp, g / ep of them
            sharded = f"8(M{sub}{by_tp} + N{sub})" + (f"/{g}" if g > 1 else "")
            sharded += f" + 8({experts})" + (f"/{g // ep}" if g > ep else "")
            moments = 8 * (M // tp + N) / g + 8 * (X // ep) / (g // ep)
        # A rank's shard of a bucket differs from 1/g of the bucket by under one element.
        figures = {
            "parameters": (text, weights, 0),
            "gradients": (text, weights, 4 * (g - 1) * buckets),
            "optimizer": (sharded, moments, 8 * (g > 1) * buckets),
        }
    parts = shapes.activations(cp, ep)
    layers = rank_layer_count(shapes.L, pp, pp_rank, layout.virtual_stages)
    text, value = stage_activations(layout, parts, layers, pp_rank == 0, pp_rank == pp - 1, routed)
    if cp > 1:
        text = f"[{text}]/{cp}"  # every part is per token: T/cp tokens, 1/cp of the bytes
    figures["activations"] = (text, value, ACTIVATION_TOLERANCE * value)
    if layout.engine == "interleaved":
        peak_text, peak, held = interleaved_peak(layout, shapes, parts, pp_rank)
        rule = "(v - 1) pp + 2(pp - pp_rank - 1) + 1: the warm-up, and one"
    else:
        held = 1 if pp == 1 else m if layout.engine == "afab" else min(pp - pp_rank, m)
        peak_text = text if held == 1 else f"{held} × {text if '+' not in text else f'({text})'}"
        peak = held * value
        rule = "1" if pp == 1 else "m" if layout.engine == "afab" else "pp - pp_rank"
    figures["peak_activations"] = (peak_text, peak, ACTIVATION_TOLERANCE * peak)
    figures["held"] = (rule, held, 0)
    return figures


### end Formulas
### begin Table
QUANTITIES = ["parameters", "gradients", "optimizer", "activations", "peak_activations"]
HEADERS = ["parameters", "gradients", "AdamW moments", "activations, 1 micro-batch", "held at most"]


def received_rows(layout, figures):
    """{rank: the rows its experts received in the step, over its layers}. Every rank's routers
    count their token slots per expert (`expert_rows`, as the step records them for its log);
    the slots for expert j go to the rank of its ep group (the manager's, from the expert
    layout: the same edp, pp, cp and tp ranks) that holds j, ep rank j // (E/ep)."""
    if not layout.moe:
        return {f["rank"]: 0 for f in figures}
    rows = {}
    for f in figures:
        local = len(f["expert_rows"][0]) // layout.ep
        mine = slice(f["coords"]["ep"] * local, (f["coords"]["ep"] + 1) * local)
        peers = [other for other in figures if other["rank"] in f["ep_group"]]
        rows[f["rank"]] = sum(sum(c[mine]) for other in peers for c in other["expert_rows"])
    return rows


def rows_of(layout, figures, shapes):
    """Ranks with the same figures share a row; each figure with its formula and a verdict."""
    for f, routed in zip(figures, received_rows(layout, figures).values(), strict=True):
        f["routed_rows"] = routed
    groups = {}
    for f in figures:
        groups.setdefault(tuple(f[q] for q in [*QUANTITIES, "held", "routed_rows"]), []).append(f)
    rows = []
    for group in groups.values():
        pp_rank = group[0]["coords"]["pp"]
        want = expected(layout, shapes, pp_rank, group[0]["routed_rows"])
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


def stage_shares(shapes, pp, v):
    """Each pipeline rank's share of the parameters: M₀ = ..., N₀ = ..., M₁ = ..."""
    sub = lambda r: str(r).translate(SUBSCRIPT)
    shares = [shapes.parameters(pp, r, v) for r in range(pp)]
    return ", ".join(f"M{sub(r)} = {m:,}, N{sub(r)} = {n:,}" for r, (m, n, _) in enumerate(shares))


def legend(shapes, layouts, args):
    """The symbols of the formulas, with their values for this run. `shapes`: the dense model's,
    and the mixture of experts' (True) where a layout has it."""
    s, parts = shapes[False], shapes[False].activations()
    M, N, _ = s.parameters()
    lines = [
        f"B = {s.B} rows of T = {s.T} tokens per micro-batch (T/cp on a cp rank); D = {s.D}, "
        f"F = {s.F}, V = {s.V}, H = {s.H} and K = {s.K} heads of d = {s.d}, L = {s.L} layers; "
        "fp32, 4 bytes a number.",
        f"M = {M:,} parameters in matrices (embedding, projections, lm_head: split by tp), "
        f"N = {N:,} in RMSNorm weights (whole on every tp rank).",
    ]
    for pp, v in sorted({(x.pp, x.virtual_stages) for x in layouts if x.pp > 1 and not x.moe}):
        where = f"pp {pp}, stage i's share" if v == 1 else f"pp {pp} x v {v}, rank i's chunks"
        lines.append(f"{where}: {stage_shares(s, pp, v)}.")
    lines.append(
        f"Saved for backward, bytes: r = {parts['r']:,} and s = {parts['s']:,} per layer (r "
        f"replicated on the tp ranks, s split), e = {parts['e']:,} (embedding), h = "
        f"{parts['h']:,} and z = {parts['z']:,} (final norm, lm_head, loss; z: the loss's one copy "
        f"of the logits, split by tp); step 3: e′ = {parts['e3']:,}, h′ = {parts['h3']:,}."
    )
    if any(x.sequence_parallel for x in layouts):
        lines.append(
            f"Sequence parallelism splits the norms' part of r and h by tp: r = n + c, n = "
            f"{parts['n']:,} (two norms), c = {parts['c']:,} (the column-parallel layers' input, "
            f"gathered, and RoPE's cos and sin: whole); h = n′ + c′, n′ = {parts['n′']:,} (the "
            f"final norm), c′ = {parts['c′']:,} (lm_head's input, gathered, and the loss's)."
        )
    if True in shapes:
        x = shapes[True]
        Mx, Nx, X = x.parameters()
        ep = max(layout.ep for layout in layouts if layout.moe)
        moe = x.activations(1, ep)
        lines.append(
            f"Step 15, {args.moe_model_name}: E = {x.E} experts in each of L = {x.L} layers, k = "
            f"{x.k} per token, each an MLP of F = {x.F}; D = {x.D}, V = {x.V}, H = {x.H} and K = "
            f"{x.K} heads of d = {x.d}. M = {Mx:,} in matrices outside the experts, N = {Nx:,} "
            f"in RMSNorm weights and routers, X = {X:,} in the experts (E/ep on each ep rank). "
            f"Saved for backward per layer: r, a = {moe['a']:,} (attention: s without the MLP), "
            f"u = {moe['u']:,} (the router: logits, probabilities, top k, weights, the slots' "
            f"indices, the rows back in slot order); and ρ = {moe['ρ']:,} for each row routed to "
            f"an expert of this rank (the row, the expert's four F-wide outputs, two indices), "
            f"times the rows its experts received over the layers: counted from every rank's "
            f"routers, as the step records them for its log."
        )
    lines.append(
        "Held at most: the most bytes saved for backward at once in the step, 1 micro-batch's "
        "without a pipeline, m's with AFAB, (pp - pp_rank)'s with 1F1B; interleaved: the "
        "chunks' forwards whose backward has not run, replayed in Megatron-LM's order."
    )
    # Lines break between the symbols' definitions, never inside "D = 256".
    wrapped = [textwrap.wrap(text.replace(" = ", "\xa0=\xa0"), 96) for text in lines]
    return "\n".join(line.replace("\xa0", " ") for text in wrapped for line in text)


### end Table
def check_layouts(layouts, configs, args):
    """Refuse, with the numbers, a model or micro-batch that a layout cannot split. `configs`:
    the dense model's, and the mixture of experts' (True)."""
    names = ["num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"]
    for layout in layouts:
        config = configs[layout.moe]
        sizes = {name: getattr(config, name) for name in names}
        where = f"step {layout.number}'s layout ({layout})"
        for name, size in sizes.items():
            if size % layout.tp:
                raise ValueError(f"{where}: tp_size={layout.tp} does not divide {name}={size}")
        chunks = layout.pp * layout.virtual_stages
        if chunks > config.num_hidden_layers:
            what = f"pp_size={layout.pp}"
            if layout.virtual_stages > 1:
                what = f"pp_size x virtual stages = {layout.pp} x {layout.virtual_stages}"
            raise ValueError(
                f"{where}: {what} needs at least {chunks} layers, the model has "
                f"num_hidden_layers={config.num_hidden_layers}"
            )
        cuts = {"2 * cp_size": 2 * layout.cp}
        if layout.sequence_parallel:  # each tp rank its T/(cp tp) tokens of the residual stream
            cuts["tp_size * cp_size"] = layout.tp * layout.cp
        for name, size in cuts.items():
            if args.seq_len % size:
                raise ValueError(
                    f"{where}: seq_len={args.seq_len} is not a multiple of {name} = {size}"
                )
        if layout.zero_stage == 3:  # every parameter's rows (its tp slice's) cut over dp x cp
            g, tp, d = layout.dp * layout.cp, layout.tp, config.head_dim
            rows = {"hidden_size": config.hidden_size}
            rows["intermediate_size / tp"] = config.intermediate_size // tp
            rows["vocab_size / tp"] = config.vocab_size // tp
            rows["num_attention_heads x head_dim / tp"] = config.num_attention_heads * d // tp
            rows["num_key_value_heads x head_dim / tp"] = config.num_key_value_heads * d // tp
            for name, size in rows.items():
                if size % g:
                    raise ValueError(
                        f"{where}: ZeRO-3 cuts every parameter's rows over dp x cp = {g} ranks; "
                        f"{name} = {size} rows"
                    )
        if layout.moe:
            E = getattr(config, "num_local_experts", 0)
            if not E:
                raise ValueError(f"{where}: --moe_model_name {args.moe_model_name} has no experts")
            if E % layout.ep:
                raise ValueError(f"{where}: ep_size={layout.ep} does not divide E={E} experts")
    for config in configs.values():
        if config.hidden_size % config.num_attention_heads:
            raise ValueError(
                f"num_attention_heads={config.num_attention_heads} does not divide "
                f"hidden_size={config.hidden_size}"
            )


def main(argv=None):
    args = parse_args(argv)
    layouts = [LAYOUTS[number] for number in args.steps]
    configs = {False: load_config(args, args.model_name)}  # the legend's sizes, always
    if any(layout.moe for layout in layouts):
        configs[True] = load_config(args, args.moe_model_name)
    try:
        check_layouts(layouts, configs, args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    shapes, rows = {moe: Shapes(config, args) for moe, config in configs.items()}, []
    for layout in layouts:
        figures = run_layout(layout, configs[layout.moe], args)
        rows += rows_of(layout, figures, shapes[layout.moe])
        print(f"step {layout.number} ({layout}): measured", file=sys.stderr, flush=True)
    heading = (
        f"Bytes per rank, {args.model_name} model, one training step on random tokens, "
        f"{args.micro_batch_size} x {args.seq_len} tokens per micro-batch; "
        "measured = formula (≈: within the tolerance)."
    )
    if True in shapes:
        heading += f" Step 15: the {args.moe_model_name} model."
    print("\n".join(textwrap.wrap(heading, 96)) + "\n")
    print(table(rows))
    print()
    print(legend(shapes, layouts, args))
    if args.json:
        records = [{"step": r["layout"].number, "layout": str(r["layout"]), "ok": r["ok"],
                    "figures": r["figures"],
                    "expected": {q: list(v) for q, v in r["expected"].items()}}
                   for r in rows]  # fmt: skip
        moe = vars(shapes[True]) if True in shapes else None
        figures = {"shapes": vars(shapes[False]), "moe_shapes": moe, "rows": records}
        Path(args.json).write_text(json.dumps(figures, indent=1))
    wrong = [f"step {r['layout'].number} ranks {r['ranks']}" for r in rows if not r["ok"]]
    if wrong:
        print(f"\nDISAGREEMENT with the formulas: {'; '.join(wrong)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
