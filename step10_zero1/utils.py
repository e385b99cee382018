"""Small helpers shared by the training scripts: devices, logging, seeds and throughput."""

import random

import numpy as np
import torch
import torch.distributed as dist

# Dense bf16 peak FLOP/s of common accelerators, matched against the device name.
PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 125e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
    "V100": 125e12,
    "T4": 65e12,
}


def log(*args, all_ranks=False):
    """Print one line from rank 0 (from every rank with `all_ranks`), tagged with the rank."""
    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank()
        if rank != 0 and not all_ranks:
            return
        if dist.get_world_size() > 1:
            args = (f"[rank {rank}]", *args)
    print(" ".join(str(a) for a in args), flush=True)  # one write, so ranks' lines do not mix


def resolve_device(name, local_rank=0):
    """'auto' picks CUDA when there is one, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def resolve_dtype(name, device):
    """The autocast dtype: bf16 on CUDA and fp32 on the CPU unless asked otherwise."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if name not in dtypes:
        raise ValueError(f"--dtype must be one of auto, {', '.join(dtypes)}; got {name!r}")
    return dtypes[name]


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def flops_per_token(config, seq_len):
    """Training FLOPs per token: 6 N for the weights plus the attention score and value matmuls.

    N counts every weight that takes part in a matmul (the input embedding is a lookup, so it is
    left out). Each layer's attention adds 6 * 2 * T * H * d; we count the full T x T matrix, as is
    usual, although the causal mask skips half of it.
    """
    D, L, F = config.hidden_size, config.num_hidden_layers, config.intermediate_size
    d = getattr(config, "head_dim", None) or D // config.num_attention_heads
    H, K = config.num_attention_heads, config.num_key_value_heads
    per_layer = D * H * d * 2 + D * K * d * 2 + 3 * D * F  # q, o, k, v and the MLP
    n = L * per_layer + D * config.vocab_size  # + lm_head
    return 6 * n + 12 * L * H * d * seq_len


def peak_flops(device, peak_tflops=None):
    """The device's peak FLOP/s for MFU: from the flag, or known from the device's name, or None."""
    if peak_tflops:
        return peak_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, flops in PEAK_FLOPS.items():
            if key in name:
                return flops
    return None
