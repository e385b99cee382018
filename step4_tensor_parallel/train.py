"""Step 4: tensor parallelism, every weight matrix split over the tp ranks (tensor_parallel.py).

torchrun --nproc_per_node 2 step4_tensor_parallel/train.py --tp_size 2
"""

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from bookkeeping import Run, agree, check_restarts, find_checkpoint, restart_store
from checkpoint import load_checkpoint, save_checkpoint
from dataloader import MicroBatchDataLoader, load_data
from flags import load_config, make_parser, parse
from kv_cache import kv_cache
from model import LlamaForCausalLM
from muon import make_optimizer
from placement import OnWhole, clip_grad_norm, model_gradients
from process_group_manager import ProcessGroupManager, check_sizes
from recipes import loss_scale, unscale, warmup_cosine
from tensor_parallel import (
    Gather,
    apply_tensor_parallel,
    check_tensor_parallel,
    vocab_parallel_cross_entropy,
)
from utils import flops_per_token, log, resolve_device, resolve_dtype, run_main, set_seed


class Context(NamedTuple):
    """What every part of the run reads and nothing changes: the flags (complete once parsed,
    never written after), the device, the autocast dtype and the grid of ranks."""

    args: object
    device: torch.device
    dtype: torch.dtype
    pgm: ProcessGroupManager


@dataclass
class State:
    """What the run trains with: the model as built (its parameters, which checkpoints save) and
    as called (compiled), the optimizer with its schedule, the loaders and the tokenizer."""

    model: torch.nn.Module
    wrapped: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    tokenizer: object
    train_loader: MicroBatchDataLoader
    val_loader: MicroBatchDataLoader


def parse_args(argv=None):
    parser, parallel = make_parser(__doc__.split("\n")[0])
    return parse(parser, argv, tokens_per_step)


def tokens_per_step(args):
    """One optimizer step's tokens: its micro-batches of micro_batch_size rows of seq_len."""
    return args.micro_batch_size * args.gradient_accumulation_steps * args.seq_len


### begin Process groups
def setup_distributed(args):
    """Join the process group that torchrun describes (or a group of one) and build the grid."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    # Checked before any collective, on every rank: a bad grid exits at once instead of hanging.
    check_sizes(world_size, args.tp_size, args.pp_size, args.dp_size)
    device = resolve_device(args.device, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=args.dist_timeout_s)  # for every group: a stall stops the job
    if "RANK" in os.environ:  # torchrun's store, each restart's keys apart from the last's
        store = restart_store(os.environ, timeout)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
    else:  # plain `python train.py`: a group of one, without a rendezvous
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    check_restarts(os.environ)  # torchrun --max_restarts: a restarted group must reconnect
    return ProcessGroupManager(args.tp_size, args.pp_size, args.dp_size, timeout=timeout), device


### end Process groups
def build_model(ctx, config):
    """Build on the meta device (no memory), allocate on `device`, then initialise from the seed."""
    args, device, dtype, pgm = ctx
    ### begin Tensor parallelism
    check_tensor_parallel(config, pgm.tp_size)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
        # The swap happens before any weight exists: each rank allocates only its slices.
        apply_tensor_parallel(model, pgm.tp_group)
    ### end Tensor parallelism
    model.to_empty(device=device)
    model.tie_weights()
    model.init_weights(args.seed)
    return model


def build_optimizer(ctx, model):
    """AdamW, weight decay on matrices only (not norms), or --optimizer muon (muon.py), which
    puts each matrix together from its tp slices (`OnWhole`); linear warm-up, then the
    --lr_schedule down to 10 %."""
    args, device, dtype, pgm = ctx
    optimizer = make_optimizer(model, args, device, on_whole=OnWhole(model, pgm))
    return optimizer, warmup_cosine(optimizer, args)


### begin Data
def build_data(ctx, config):
    """The tokenizer and loaders for the training rows (shuffled) and the validation rows."""
    args, device, dtype, pgm = ctx
    tokenizer, train, validation = load_data(args, config.vocab_size)
    train_loader = MicroBatchDataLoader(train, args.micro_batch_size, args.seed, device)
    val_loader = MicroBatchDataLoader(validation, args.micro_batch_size, args.seed, device, False)
    return tokenizer, train_loader, val_loader


### end Data


def loss_fn(logits, targets, pgm):
    ### begin Tensor parallelism
    # The logits are split over the vocabulary, (B, T, V/tp); the loss is reduced across tp.
    return vocab_parallel_cross_entropy(logits, targets, pgm.tp_group)
    ### end Tensor parallelism


def train_step(ctx, state, micro_batches):
    """One optimizer step over the micro-batches of a batch; returns the mean loss and grad norm."""
    args, device, dtype, pgm = ctx
    model, optimizer, scheduler = state.wrapped, state.optimizer, state.scheduler
    model.zero_grad(set_to_none=True)
    scale = loss_scale(optimizer)  # --dtype float16: gradients S times larger; else 1
    total = torch.zeros((), device=device)
    for inputs, targets in micro_batches:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            logits = model(inputs)  # (B, T, V/tp)
        # Dividing by the number of micro-batches makes the accumulated gradient the mean over
        # the whole batch, the same as one backward over one large batch.
        loss = loss_fn(logits, targets, pgm) / len(micro_batches)
        (loss * scale).backward()
        total += loss.detach()
    grad_norm = clip_grad_norm(model_gradients(model, ["tp"]), args.grad_clip * scale, pgm) / scale
    facts = agree(total, grad_norm, counted=pgm.tp_rank == 0)  # tp's copies of the loss: once
    if facts.finite:  # on every rank alike: a non-finite step changes nothing
        unscale(optimizer, scale)
        optimizer.step()
        scheduler.step()
    return facts


@torch.no_grad()
def evaluate(ctx, state):
    """The mean loss over the first --eval_steps validation micro-batches, the same every time."""
    args, device, dtype, pgm = ctx
    model, loader = state.model, state.val_loader
    model.eval()
    loader.load_state_dict({"position": 0})
    total = torch.zeros((), device=device)
    for _ in range(args.eval_steps):
        inputs, targets = next(loader)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            total += loss_fn(model(inputs), targets, pgm)
    model.train()
    return (total / args.eval_steps).item()


@torch.no_grad()
def sample(ctx, state, top_k=20, temperature=0.8):
    """Continue --sample_prompt by --sample_tokens tokens, sampling among the top-k next ones.
    Every tp rank gathers the full logits and draws from the same generator, so all pick the same
    token."""
    args, device, dtype, pgm = ctx
    model, tokenizer = state.model, state.tokenizer
    model.eval()
    generator = torch.Generator(device).manual_seed(args.seed)
    prompt = tokenizer.encode(args.sample_prompt, add_special_tokens=False)
    ids = new = torch.tensor([prompt], device=device)  # (1, T)
    with kv_cache(model):  # the model sees each token once: the prompt, then one at a time
        for _ in range(args.sample_tokens):
            logits = Gather.apply(model(new)[:, -1], pgm.tp_group).float() / temperature  # (1, V)
            top, index = logits.topk(top_k)
            choice = torch.multinomial(top.softmax(-1), 1, generator=generator)  # (1, 1)
            new = index.gather(-1, choice)
            ids = torch.cat([ids, new], dim=1)
    model.train()
    return tokenizer.decode(ids[0])


def main(argv=None):
    args = parse_args(argv)
    pgm, device = setup_distributed(args)
    log(pgm, all_ranks=True)
    dtype = resolve_dtype(args.dtype, device)
    ctx = Context(args, device, dtype, pgm)
    set_seed(args.seed)
    config = load_config(args)
    # Per device: all world_size devices share the work of the step's tokens.
    run = Run(args, device, flops_per_token(config, args.seq_len) / pgm.world_size, pgm)
    model = build_model(ctx, config)
    optimizer, scheduler = build_optimizer(ctx, model)
    wrapped = torch.compile(model) if args.compile else model
    params = sum(p.numel() for p in model.parameters())
    log(f"model {args.model_name}: {params:,} parameters per rank on {device}, autocast {dtype}")
    state = State(model, wrapped, optimizer, scheduler, *build_data(ctx, config))
    checkpoint = find_checkpoint(args)
    if checkpoint:
        step = load_checkpoint(ctx, state, checkpoint)
        run.resumed(step, optimizer, scheduler, state.train_loader.position * args.seq_len)
    for step in range(run.start_step + 1, run.max_steps + 1):
        run.begin(step, optimizer)
        batch = [next(state.train_loader) for _ in range(args.gradient_accumulation_steps)]
        with run.communication():  # --comm_stats: what the step sends
            facts = train_step(ctx, state, batch)
        run.end(facts, state.train_loader.position * args.seq_len)
        if run.should_validate():
            run.record["val_loss"] = evaluate(ctx, state)
        run.log_step()
        if run.should_save():
            run.save(save_checkpoint, ctx, state, step)
        if run.should_stop():
            break
    run.close()
    if not run.stopped:  # the seconds before the cluster kills the job go to the checkpoint only
        log(f"sample: {sample(ctx, state)!r}")
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
