"""The step-1 model against transformers' LlamaForCausalLM: same keys, same logits, same loading."""

import pytest
import torch
import transformers
from conftest import import_step

model_lib = import_step("step1_model", "model")

SHAPES = [
    # (heads, kv heads, tied, rope_theta)
    (4, 4, False, 10000.0),  # multi-head
    (4, 2, True, 500000.0),  # grouped-query, tied embeddings, another RoPE base
    (8, 1, False, 10000.0),  # multi-query
]


def hf_config(heads, kv_heads, tied, theta, **extra):
    return transformers.LlamaConfig(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=tied,
        rope_theta=theta,
        max_position_embeddings=64,
        **extra,
    )


@pytest.mark.parametrize("heads, kv_heads, tied, theta", SHAPES)
def test_same_keys_and_logits_as_transformers(heads, kv_heads, tied, theta):
    config = hf_config(heads, kv_heads, tied, theta)
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).eval()
    model = model_lib.LlamaForCausalLM(config)
    assert model.state_dict().keys() == reference.state_dict().keys()
    model.load_state_dict(reference.state_dict())
    input_ids = torch.randint(0, config.vocab_size, (3, 17))
    expected = reference(input_ids).logits
    torch.testing.assert_close(model(input_ids), expected, rtol=1e-5, atol=1e-5)
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_loads_a_transformers_checkpoint_from_disk(tmp_path):
    """save_pretrained writes safetensors without the tied lm_head; our model still loads it."""
    config = hf_config(4, 2, True, 10000.0)
    torch.manual_seed(1)
    reference = transformers.LlamaForCausalLM(config).eval()
    reference.save_pretrained(tmp_path)
    from safetensors.torch import load_model

    model = model_lib.LlamaForCausalLM(config)
    load_model(model, str(tmp_path / "model.safetensors"), strict=False)
    model.tie_weights()
    input_ids = torch.randint(0, config.vocab_size, (2, 9))
    torch.testing.assert_close(model(input_ids), reference(input_ids).logits, rtol=1e-5, atol=1e-5)


def test_head_dim_differs_from_hidden_over_heads():
    """Some Llama configs set head_dim explicitly; shapes must follow it, not hidden / heads."""
    config = hf_config(4, 2, False, 10000.0, head_dim=8)
    torch.manual_seed(2)
    reference = transformers.LlamaForCausalLM(config).eval()
    model = model_lib.LlamaForCausalLM(config)
    model.load_state_dict(reference.state_dict())
    input_ids = torch.randint(0, config.vocab_size, (2, 11))
    torch.testing.assert_close(model(input_ids), reference(input_ids).logits, rtol=1e-5, atol=1e-5)


def build(config, seed):
    with torch.device("meta"):
        model = model_lib.LlamaForCausalLM(config)
    model.to_empty(device="cpu")
    model.tie_weights()
    model.init_weights(seed)
    return model


def test_init_is_a_function_of_seed_and_name():
    config = hf_config(4, 2, False, 10000.0)
    a, b, c = build(config, 7), build(config, 7), build(config, 8)
    for (name, pa), pb, pc in zip(
        a.named_parameters(), b.parameters(), c.parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
        if pa.ndim == 2:
            assert not torch.equal(pa, pc), name
            assert abs(pa.std().item() - config.initializer_range) < 0.003, name
            # The value can be made alone, from the name and the seed, without the model.
            alone = model_lib.initial_value(name, pa.shape, config.initializer_range, 7)
            assert torch.equal(pa, alone), name
        else:
            assert torch.equal(pa, torch.ones_like(pa)), name
    # Two parameters of the same shape get different values.
    q0 = a.model.layers[0].self_attn.q_proj.weight
    q1 = a.model.layers[1].self_attn.q_proj.weight
    assert not torch.equal(q0, q1)


def test_init_is_the_same_with_fewer_layers():
    """A pipeline stage holds some layers only; their weights must not depend on the others."""
    full = build(hf_config(4, 2, False, 10000.0), 3)
    config = hf_config(4, 2, False, 10000.0)
    config.num_hidden_layers = 1
    short = build(config, 3)
    for name, param in short.named_parameters():
        assert torch.equal(param, full.get_parameter(name)), name


def test_tied_init_survives_meta_build():
    model = build(hf_config(4, 2, True, 10000.0), 5)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    expected = model_lib.initial_value("model.embed_tokens.weight", (101, 64), 0.02, 5)
    assert torch.equal(model.lm_head.weight, expected)


def test_a_sliced_module_initialises_its_slice():
    """A module with init_parameter receives the full parameter's maker and keeps its slice."""
    config = hf_config(4, 2, False, 10000.0)
    full = build(config, 11)

    class HalfRows(torch.nn.Linear):
        def init_parameter(self, name, make_full):
            return make_full((2 * self.out_features, self.in_features))[self.out_features :]

    model = build(config, 11)
    mlp = model.model.layers[1].mlp
    mlp.up_proj = HalfRows(64, 48, bias=False)
    model.init_weights(11)
    assert torch.equal(mlp.up_proj.weight, full.model.layers[1].mlp.up_proj.weight[48:])


def test_rejects_unsupported_rope_scaling():
    config = hf_config(4, 2, False, 10000.0)
    config.rope_parameters = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}
    with pytest.raises(ValueError, match="llama3"):
        model_lib.LlamaForCausalLM(config)
