"""Step 2: start N processes and place each in a (dp, pp, tp) grid of process groups.

Nothing is parallel yet: every rank still trains its own copy of the step 1 model on the same
fixed batch. What is new is the launch (torchrun sets RANK, WORLD_SIZE and LOCAL_RANK), one
device per rank, the process groups every later technique talks through, and the refusal of a
grid that does not fit the world.

    torchrun --nproc_per_node 4 step2_process_group_manager/train.py --tp_size 2 --dp_size 2
"""

import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoConfig

from model import LlamaForCausalLM
from process_group_manager import ProcessGroupManager, check_sizes
from utils import (
    ArgumentParser,
    flops_per_token,
    log,
    peak_flops,
    resolve_device,
    resolve_dtype,
    run_main,
    set_seed,
    throughput,
)

ASSETS = Path(__file__).resolve().parent.parent / "assets"
OVERRIDES = [
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
]


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model_name",
        default="tiny",
        help="a config in assets/configs (tiny, smollm-135m, ...), a local directory or a hub id",
    )
    for name in OVERRIDES:
        model.add_argument(f"--{name}", type=int, help="override the config's value")
    train = parser.add_argument_group("training")
    train.add_argument("--seq_len", type=int, default=256)
    train.add_argument("--micro_batch_size", type=int, default=16)
    train.add_argument("--gradient_accumulation_steps", type=int, default=1)
    train.add_argument("--max_steps", type=int, default=150)
    train.add_argument("--learning_rate", type=float, default=3e-3)
    train.add_argument("--warmup_steps", type=int, default=10)
    train.add_argument("--weight_decay", type=float, default=0.1)
    train.add_argument("--grad_clip", type=float, default=1.0)
    train.add_argument("--seed", type=int, default=42)
    system = parser.add_argument_group("system")
    system.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    system.add_argument("--dtype", default="auto", help="autocast dtype: auto, float32, bfloat16")
    system.add_argument("--compile", action="store_true", help="torch.compile the model")
    system.add_argument("--peak_tflops", type=float, help="the device's peak, for MFU")
    system.add_argument("--log_every", type=int, default=1)
    parallel = parser.add_argument_group("parallelism (tp_size * pp_size * dp_size = world size)")
    parallel.add_argument("--tp_size", type=int, default=1, help="tensor-parallel ranks")
    parallel.add_argument("--dp_size", type=int, default=1, help="data-parallel ranks")
    parallel.add_argument("--pp_size", type=int, default=1, help="pipeline stages")
    args = parser.parse_args(argv)
    for name in [
        "seq_len",
        "micro_batch_size",
        "gradient_accumulation_steps",
        "max_steps",
        "log_every",
    ]:
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    for name in OVERRIDES:
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    for name in ["learning_rate", "grad_clip"]:
        if not getattr(args, name) > 0:
            parser.error(f"--{name} must be above 0, got {getattr(args, name)}")
    for name in ["weight_decay", "warmup_steps"]:
        if not getattr(args, name) >= 0:
            parser.error(f"--{name} must be 0 or more, got {getattr(args, name)}")
    return args


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
    if "RANK" in os.environ:
        dist.init_process_group(backend, rank=rank, world_size=world_size)
    else:  # plain `python train.py`: a group of one, without a rendezvous
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return ProcessGroupManager(args.tp_size, args.pp_size, args.dp_size), device


### end Process groups
def load_config(args):
    """A LlamaConfig from assets/configs/NAME, a local directory or the hub, with overrides."""
    name = args.model_name
    if (ASSETS / "configs" / name).is_dir():
        name = str(ASSETS / "configs" / name)
    try:
        config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as error:  # ValueError: a folder without a config.json
        where = (
            "the folder has no valid config.json"
            if Path(name).is_dir()
            else "no such local directory, and the Hugging Face hub could not be reached or "
            "has no such model"
        )
        raise ValueError(
            f"could not load the model config {args.model_name!r}: {where}. The offline default "
            f"is --model_name tiny; assets/configs holds the others.\n{error}"
        ) from error
    if config.model_type != "llama":
        raise ValueError(f"{args.model_name!r} is a {config.model_type!r} model, not a Llama one")
    for key in OVERRIDES:
        if getattr(args, key) is not None:
            setattr(config, key, getattr(args, key))
            if key in ("hidden_size", "num_attention_heads"):
                config.head_dim = config.hidden_size // config.num_attention_heads
    H, K, D = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
    if D % H:
        raise ValueError(f"num_attention_heads={H} does not divide hidden_size={D}")
    if H % K:
        raise ValueError(f"num_key_value_heads={K} does not divide num_attention_heads={H}")
    d = getattr(config, "head_dim", None) or D // H
    if d % 2:
        raise ValueError(
            f"head_dim={d} (hidden_size / num_attention_heads = {D} / {H}) is odd: the rotary "
            f"embedding turns pairs of dimensions, so it must be even"
        )
    if args.seq_len > config.max_position_embeddings:
        raise ValueError(
            f"seq_len={args.seq_len} exceeds "
            f"max_position_embeddings={config.max_position_embeddings}"
        )
    return config


def build_model(config, device, seed):
    """Build on the meta device (no memory), allocate on `device`, then initialise from the seed."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device=device)
    model.tie_weights()
    model.init_weights(seed)
    return model


def build_optimizer(model, args, device):
    """AdamW, weight decay on matrices only (not norms); linear warm-up, cosine decay to 10 %."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": args.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    fused = device.type in ("cuda", "cpu")
    optimizer = torch.optim.AdamW(groups, lr=args.learning_rate, betas=(0.9, 0.95), fused=fused)

    def lr_factor(step):
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


def fixed_batch(config, args, device):
    """One batch of random tokens, cut into micro-batches of (inputs, targets) shifted by one."""
    generator = torch.Generator().manual_seed(args.seed)
    rows = args.micro_batch_size * args.gradient_accumulation_steps
    tokens = torch.randint(config.vocab_size, (rows, args.seq_len + 1), generator=generator)
    tokens = tokens.to(device)
    return [(t[:, :-1], t[:, 1:]) for t in tokens.split(args.micro_batch_size)]  # (B, T) each


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())  # (B*T, V)


def train_step(model, micro_batches, optimizer, scheduler, args, device, dtype):
    """One optimizer step over the micro-batches of a batch; returns the mean loss and grad norm."""
    model.zero_grad(set_to_none=True)
    total = torch.zeros((), device=device)
    for inputs, targets in micro_batches:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            logits = model(inputs)  # (B, T, V)
        # Dividing by the number of micro-batches makes the accumulated gradient the mean over
        # the whole batch, the same as one backward over one large batch.
        loss = loss_fn(logits, targets) / len(micro_batches)
        loss.backward()
        total += loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    optimizer.step()
    scheduler.step()
    return total.item(), grad_norm.item()


def main(argv=None):
    args = parse_args(argv)
    pgm, device = setup_distributed(args)
    log(pgm, all_ranks=True)
    dtype = resolve_dtype(args.dtype, device)
    set_seed(args.seed)
    config = load_config(args)
    model = build_model(config, device, args.seed)
    optimizer, scheduler = build_optimizer(model, args, device)
    step_fn = torch.compile(model) if args.compile else model
    num_params = sum(p.numel() for p in model.parameters())
    log(f"model {args.model_name}: {num_params:,} parameters on {device}, autocast {dtype}")

    micro_batches = fixed_batch(config, args, device)
    tokens_per_step = args.micro_batch_size * args.gradient_accumulation_steps * args.seq_len
    flops, peak = flops_per_token(config, args.seq_len), peak_flops(device, args.peak_tflops)
    for step in range(1, args.max_steps + 1):
        start, lr = time.perf_counter(), scheduler.get_last_lr()[0]
        loss, grad_norm = train_step(
            step_fn, micro_batches, optimizer, scheduler, args, device, dtype
        )
        tokens_per_second = tokens_per_step / (time.perf_counter() - start)
        if step % args.log_every == 0 or step == args.max_steps:
            log(
                f"step {step}/{args.max_steps} | loss {loss:.4f} | lr {lr:.2e}"
                f" | grad_norm {grad_norm:.3f} | {tokens_per_second:,.0f} tok/s"
                f" | {throughput(flops * tokens_per_second, peak)}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
