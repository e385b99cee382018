"""On a CUDA GPU (skipped elsewhere): the model against transformers' in fp32 and under bf16
autocast, and attention on a fused kernel in bf16. tools/gpu_check.sh runs these."""

import pytest
import torch
import transformers
from conftest import import_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

model_lib = import_step("step1_model", "model")


def config():
    """SmolLM-shaped attention (grouped-query, head dim 64), few layers, a small vocabulary."""
    return transformers.LlamaConfig(
        vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True,
    )  # fmt: skip


def pair(device):
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config()).to(device).eval()
    model = model_lib.LlamaForCausalLM(config()).to(device).eval()
    model.load_state_dict(reference.state_dict())
    return model, reference


@torch.no_grad()
def test_logits_equal_transformers_on_cuda_fp32_and_bf16():
    device = torch.device("cuda")
    model, reference = pair(device)
    input_ids = torch.randint(0, 2048, (4, 256), device=device)
    expected = reference(input_ids).logits.float()
    torch.testing.assert_close(model(input_ids), expected, rtol=1e-4, atol=1e-4)
    # bf16 rounds differently in each kernel; ours must be as close to fp32 as transformers is.
    with torch.autocast("cuda", torch.bfloat16):
        ours = model(input_ids).float()
        theirs = reference(input_ids).logits.float()
    our_error = (ours - expected).abs().max().item()
    their_error = (theirs - expected).abs().max().item()
    assert our_error <= 1.5 * their_error + 1e-3, (our_error, their_error)
    assert (ours - theirs).abs().max().item() <= 2 * their_error + 1e-3


def test_attention_runs_a_fused_kernel_in_bf16():
    """With only the flash and memory-efficient kernels allowed, the math fallback cannot hide: a
    forward and backward that no fused kernel takes raise 'No available kernel'."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model, _ = pair(torch.device("cuda"))
    model.train()
    input_ids = torch.randint(0, 2048, (4, 256), device="cuda")
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    with sdpa_kernel(fused), torch.autocast("cuda", torch.bfloat16):
        model(input_ids).float().logsumexp(-1).mean().backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None
