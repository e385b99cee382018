"""Continue a prompt with the model of a pico3d checkpoint of any parallel layout.

The shards are merged in this one process (load_merged_state_dict in export_hf.py), so a
checkpoint that eight ranks wrote samples on a laptop. The model is transformers' own
LlamaForCausalLM (MixtralForCausalLM for step 15's mixture of experts), so this tool depends on no
step folder.

    python tools/sample.py checkpoints/run --prompt "Once upon a time" --temperature 0
"""

# T tokens, V vocabulary, k top-k

import argparse
import inspect
import sys
import time

import torch
from export_hf import (
    EMBED,
    LM_HEAD,
    ROOT,
    add_model_args,
    config_from_args,
    load_merged_state_dict,
    resolve_tokenizer,
)
from transformers import AutoTokenizer, LlamaForCausalLM, MixtralForCausalLM


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a step folder, or a run folder with a `latest` file")
    parser.add_argument("--prompt", default="Once upon a time")
    parser.add_argument("--num_tokens", type=int, default=60, help="tokens to add to the prompt")
    parser.add_argument(
        "--tokenizer_name",
        default=str(ROOT / "assets" / "tokenizers" / "tinytales"),
        help="assets/tokenizers/NAME or a tokenizer folder",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--top_k", type=int, default=20, help="draw among the k likeliest tokens")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 picks the likeliest")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument(
        "--no_cache", action="store_true", help="recompute the whole prefix at every token"
    )
    add_model_args(parser)
    args = parser.parse_args(argv)
    if args.num_tokens < 0 or args.top_k < 1 or args.temperature < 0:
        parser.error(
            f"need --num_tokens >= 0, --top_k >= 1 and --temperature >= 0; got "
            f"{args.num_tokens}, {args.top_k} and {args.temperature}"
        )
    return args


# transformers' name for the KV cache, as an argument and in the output: `cache` in recent
# versions (5.24 here), `past_key_values` in older ones.
FORWARD = inspect.signature(LlamaForCausalLM.forward).parameters
CACHE = "cache" if "cache" in FORWARD else "past_key_values"


def resolve_device(name):
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def fuse_experts(state_dict, config):
    """A Mixtral checkpoint's experts (step 15: each expert's w1, w3 and w2, as transformers saves
    them) as MixtralForCausalLM holds them in memory: per layer, gate_up_proj (E, 2F, D), w1 then
    w3 of each expert, and down_proj (E, D, F)."""
    fused = {k: v for k, v in state_dict.items() if ".block_sparse_moe.experts." not in k}
    for i in range(config.num_hidden_layers):
        moe, E = f"model.layers.{i}.block_sparse_moe", config.num_local_experts
        weight = lambda e, w, moe=moe: state_dict[f"{moe}.experts.{e}.{w}.weight"]  # noqa: E731
        prefix = f"model.layers.{i}.mlp"
        fused[f"{prefix}.gate.weight"] = fused.pop(f"{moe}.gate.weight")
        fused[f"{prefix}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([weight(e, "w1"), weight(e, "w3")]) for e in range(E)]
        )
        fused[f"{prefix}.experts.down_proj"] = torch.stack([weight(e, "w2") for e in range(E)])
    return fused


def build_model(state_dict, config, device):
    """transformers' Llama (or Mixtral, for a mixture of experts) holding the merged weights.
    Loading is strict, so a key that the merge got wrong fails here instead of leaving a randomly
    initialised weight."""
    moe = config.model_type == "mixtral"
    with device:
        model = (MixtralForCausalLM if moe else LlamaForCausalLM)(config)
    if moe:
        state_dict = fuse_experts(state_dict, config)
    if config.tie_word_embeddings:  # the model lists the shared table under both names
        state_dict = {**state_dict, LM_HEAD: state_dict[EMBED]}
    model.load_state_dict(state_dict, strict=True)
    model.tie_weights()
    return model.eval()


@torch.no_grad()
def sample(model, tokenizer, prompt, num_tokens, seed=0, top_k=20, temperature=0.8, cache=True):
    """Continue `prompt` one token at a time: with temperature 0 the likeliest token, else a
    draw among the top-k logits divided by the temperature, from a generator seeded by `seed`.
    With `cache`, the model's own KV cache: each call feeds only the new token."""
    device = model.device
    generator = torch.Generator(device).manual_seed(seed)
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)], device=device)
    if ids.numel() == 0:
        raise ValueError(f"the prompt {prompt!r} has no tokens")
    context = model.config.max_position_embeddings  # RoPE was trained on no longer sequences
    past, new = None, ids
    for _ in range(num_tokens):
        if not cache or ids.shape[1] > context:  # past the context: the last `context` again
            logits = model(ids[:, -context:], use_cache=False).logits[:, -1].float()  # (1, V)
        else:
            output = model(new, **{CACHE: past}, use_cache=True)
            past, logits = output[CACHE], output.logits[:, -1].float()  # (1, V)
        if temperature == 0:
            next_id = logits.argmax(-1, keepdim=True)  # (1, 1)
        else:
            top, index = (logits / temperature).topk(min(top_k, logits.size(-1)))  # (1, k)
            choice = torch.multinomial(top.softmax(-1), 1, generator=generator)  # (1, 1)
            next_id = index.gather(-1, choice)  # (1, 1)
        ids, new = torch.cat([ids, next_id], dim=1), next_id  # (1, T + 1), (1, 1)
    return tokenizer.decode(ids[0])


def main(argv=None):
    args = parse_args(argv)
    device = resolve_device(args.device)
    try:
        state_dict, config = load_merged_state_dict(args.checkpoint, config_from_args(args))
        folder = resolve_tokenizer(args.tokenizer_name)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        if len(tokenizer) > config.vocab_size:
            raise ValueError(
                f"the tokenizer {args.tokenizer_name} has {len(tokenizer)} tokens, more than "
                f"the model's vocab_size={config.vocab_size}"
            )
        model = build_model(state_dict, config, device)
        num_params = sum(p.numel() for p in model.parameters())
        print(f"{args.checkpoint}: {num_params:,} parameters on {device}", file=sys.stderr)
        start = time.perf_counter()
        text = sample(
            model, tokenizer, args.prompt, args.num_tokens, args.seed, args.top_k, args.temperature,
            cache=not args.no_cache,
        )  # fmt: skip
        rate = args.num_tokens / (time.perf_counter() - start)
        way = "recomputing the prefix" if args.no_cache else "with the KV cache"
        print(f"{args.num_tokens} tokens, {rate:,.0f} tokens/s {way}", file=sys.stderr)
    except ValueError as error:
        print(f"sample.py: error: {error}", file=sys.stderr)
        sys.exit(2)
    print(text)


if __name__ == "__main__":
    main()
