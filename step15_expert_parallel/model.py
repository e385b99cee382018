"""A Llama decoder, written once and shared byte-for-byte by every step.

Module names and nesting follow transformers' `LlamaForCausalLM`, so the state-dict keys are the
same and a checkpoint saved by transformers loads with `load_state_dict`. The model knows nothing
about devices or process groups: tensor parallelism swaps its linear layers from outside, and
pipeline parallelism runs a slice of its layers. That is why local head counts are read from tensor
shapes and never from the config.
"""

# B batch, T tokens, D hidden, H query heads, K key/value heads, d head dim, V vocab, F MLP width

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn


def check_config(config):
    """Refuse, naming the field and its value, every config that this model would not compute
    exactly as transformers' LlamaForCausalLM does. The step 1 README lists each field."""
    act = getattr(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers' two names for x * sigmoid(x)
        raise ValueError(f"hidden_act={act!r} is not supported: the MLP here is SwiGLU ('silu')")
    for field in ("attention_bias", "mlp_bias"):
        if getattr(config, field, False):
            raise ValueError(
                f"{field}={getattr(config, field)!r} is not supported: the linear layers here (and "
                f"their tensor-parallel versions) have no bias; only {field}=False is"
            )
    dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    if dropout:
        raise ValueError(
            f"attention_dropout={dropout!r} is not supported: the model has no dropout; "
            f"set it to 0.0"
        )
    if getattr(config, "is_causal", True) is not True:
        raise ValueError(f"is_causal={config.is_causal!r} is not supported: attention is causal")
    pad = getattr(config, "pad_token_id", None)
    if pad is not None and not 0 <= pad < config.vocab_size:
        raise ValueError(
            f"pad_token_id={pad!r} is not a token of vocab_size={config.vocab_size}; "
            f"set it to null or to a token id"
        )
    rope = rope_parameters(config)
    llama3 = ["factor", "low_freq_factor", "high_freq_factor"]
    required = {"default": [], "linear": ["factor"], "llama3": llama3}
    if rope["rope_type"] not in required:
        raise ValueError(
            f"rope_type={rope['rope_type']!r} is not supported: only "
            f"{', '.join(map(repr, required))} RoPE are"
        )
    for key in required[rope["rope_type"]]:
        if key not in rope:
            raise ValueError(f"rope_type={rope['rope_type']!r} needs {key} in rope_parameters")
    if rope["rope_type"] == "llama3" and rope["high_freq_factor"] <= rope["low_freq_factor"]:
        raise ValueError(
            f"high_freq_factor={rope['high_freq_factor']!r} must be larger than "
            f"low_freq_factor={rope['low_freq_factor']!r}"
        )
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"partial_rotary_factor={rope['partial_rotary_factor']!r} is not supported: "
            f"Llama rotates the whole head"
        )


def rope_parameters(config):
    """The RoPE settings as one dict with `rope_type` and `rope_theta`. transformers 5 keeps them
    in `config.rope_parameters`; version 4 has `config.rope_theta` and the scaling in
    `config.rope_scaling`, whose type was once called `type`."""
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = getattr(config, "rope_scaling", None) or {}
        params = {"rope_theta": getattr(config, "rope_theta", 10000.0), **params}
    params = {"rope_type": params.get("type", "default"), "rope_theta": 10000.0, **params}
    if params["rope_type"] == "llama3":  # as transformers, when the original length is not given
        params.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    return params


def head_dim(config):
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def initial_value(name, shape, std, seed):
    """The initial value of parameter `name` (its state-dict key) for a seed, always on the CPU.

    It depends on the seed and the name only, so a tensor-parallel rank or a pipeline stage can
    make exactly the weights the single-device model has, one full parameter at a time, and keep
    its slice.
    """
    if len(shape) == 1:  # the only vectors in Llama are RMSNorm weights
        return torch.ones(shape)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.empty(shape).normal_(0.0, std, generator=generator)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # Normalise in fp32 even under autocast, then cast back, as transformers does.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_frequencies(dim, rope, device):
    """The rotation frequency of each pair of head dims, (d/2,), in fp32: theta^(-2i/d), then
    scaled as `rope_type` says."""
    inv_freq = 1.0 / rope["rope_theta"] ** (torch.arange(0, dim, 2, device=device).float() / dim)
    if rope["rope_type"] == "linear":  # positions divided by `factor`: the same as frequencies
        return inv_freq / rope["factor"]
    if rope["rope_type"] == "llama3":
        # Llama 3.1's long-context scaling. Slow rotations (wavelength above L / low_freq_factor,
        # L the context length of pre-training) are divided by `factor`, as with "linear", fast
        # ones (below L / high_freq_factor) are kept, and those between blend the two.
        low, high = rope["low_freq_factor"], rope["high_freq_factor"]
        wavelength = 2 * math.pi / inv_freq  # (d/2,)
        position = rope["original_max_position_embeddings"] / wavelength  # rotations in L
        kept = ((position - low) / (high - low)).clamp(0.0, 1.0)  # 0: scaled, 1: kept
        return (1 - kept) * inv_freq / rope["factor"] + kept * inv_freq
    return inv_freq


def rotary_cos_sin(seq_len, dim, rope, device):
    """cos and sin of the rotation angles of positions 0..T-1, each (T, d), in fp32."""
    inv_freq = rope_frequencies(dim, rope, device)  # (d/2,)
    angles = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)  # (T, d/2)
    angles = torch.cat((angles, angles), dim=-1)  # (T, d)
    return angles.cos(), angles.sin()


def apply_rotary(x, cos, sin):
    # transformers' convention: the head dim is split in two halves (not interleaved pairs).
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        d = head_dim(config)
        self.head_dim = d
        self.rope = rope_parameters(config)
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * d, config.hidden_size, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        # -1 instead of a head count: under tensor parallelism each rank holds only some heads.
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, d)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, K, T, d)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, K, T, d)
        cos, sin = rotary_cos_sin(T, self.head_dim, self.rope, x.device)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # Grouped-query attention: each key/value head serves H / K query heads.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, H, T, d)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, H*d)
        return self.o_proj(y)  # (B, T, D)


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        D, F_ = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(D, F_, bias=False)
        self.up_proj = nn.Linear(D, F_, bias=False)
        self.down_proj = nn.Linear(F_, D, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # (B, T, F) -> (B, T, D)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        # Like transformers, the pad token's row gets no gradient from its lookups.
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, padding_idx=getattr(config, "pad_token_id", None)
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids):
        x = self.embed_tokens(input_ids)  # (B, T) -> (B, T, D)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        check_config(config)  # before anything is built: the steps read weights only after
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self):
        """Share the embedding with lm_head when the config says so. Call again after `to_empty`,
        which gives every parameter new storage and so unties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids):
        return self.lm_head(self.model(input_ids))  # (B, T, V)

    @torch.no_grad()
    def init_weights(self, seed):
        """Give every parameter its `initial_value`: N(0, initializer_range), RMSNorm weights one.

        A module that holds only a slice of its parameter (a tensor-parallel layer) defines
        `init_parameter(name, make_full)`: it calls `make_full(full_shape)` and returns its slice.
        The model can be built on the meta device and moved with `to_empty` first, so that no rank
        ever holds more than its own weights and one full parameter.
        """
        std = self.config.initializer_range
        done = set()
        for prefix, module in self.named_modules():
            for name, param in module.named_parameters(recurse=False):
                if id(param) in done:  # tied embeddings: the weight is made once, as embed_tokens
                    continue
                done.add(id(param))
                key = f"{prefix}.{name}" if prefix else name

                def make_full(shape, key=key):
                    return initial_value(key, shape, std, seed)

                init_parameter = getattr(module, "init_parameter", None)
                value = (
                    init_parameter(name, make_full) if init_parameter else make_full(param.shape)
                )
                param.copy_(value)
