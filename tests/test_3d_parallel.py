"""Step 9: a 2 x 2 x 2 run resumes exactly; a transformers checkpoint loads into any layout; a
checkpoint of any layout exports to transformers with the trainer's own validation loss."""

import sys

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import ROOT, TINY, check, import_step, read_log, run_step

STEP = "step9_3d_parallel"
GRID = ["--tp_size", "2", "--dp_size", "2", "--pp_size", "2", "--pp_engine", "1f1b"]
COMMON = ["--num_proc", "1", "--sample_tokens", "4", "--eval_steps", "2"]


def first_micro_batches(split, count, micro_batch_size=2, seq_len=32, seed=42):
    """The micro-batches the trainer reads first, made by step 3's own loader."""
    data = import_step("step3_dataloader", "dataloader")
    tokenizer = data.load_tokenizer("tinytales")
    train, validation = data.load_splits("tinytales", seed)
    rows = data.tokenize(train if split == "train" else validation, tokenizer, seq_len, 1)
    loader = data.MicroBatchDataLoader(rows, micro_batch_size, seed, "cpu", split == "train")
    return [next(loader) for _ in range(count)]


@torch.no_grad()
def mean_loss(model, batches):
    losses = [F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten()) for x, y in batches]
    return torch.stack(losses).mean().item()


@pytest.fixture(scope="module")
def grid_run(tmp_path_factory):
    """20 steps at tp 2 x dp 2 x pp 2 (8 processes), checkpoints at 10 and 20."""
    tmp = tmp_path_factory.mktemp("grid")
    log_file, save = tmp / "log.jsonl", tmp / "ckpt"
    args = [*TINY, *GRID, *COMMON, "--max_steps", "20", "--eval_every", "10", "--log_file"]
    args += [str(log_file), "--save_dir", str(save), "--save_every", "10"]
    result = check(run_step(STEP, args, nproc=8))
    return args, read_log(log_file), save, result


def test_grid_resumes_with_identical_losses(tmp_path, grid_run):
    args, records, save, _ = grid_run
    (save / "latest").write_text("step_000010")  # as if the run had died after step 10
    resumed_log = tmp_path / "resumed.jsonl"
    args = [*args[: args.index("--log_file")], "--log_file", str(resumed_log)]
    args += ["--save_dir", str(save), "--resume"]
    check(run_step(STEP, args, nproc=8))
    resumed = read_log(resumed_log)
    assert [r["step"] for r in resumed] == list(range(11, 21))
    for got, want in zip(resumed, records[10:], strict=True):
        assert (got["loss"], got["grad_norm"]) == (want["loss"], want["grad_norm"]), got["step"]
    assert resumed[-1]["val_loss"] == records[-1]["val_loss"]


def test_grid_checkpoint_exports_to_transformers(tmp_path, grid_run):
    """The exported model's validation loss is the one the 8 ranks logged at that step."""
    _, records, save, _ = grid_run
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from export_hf import export
    finally:
        sys.path.remove(str(ROOT / "tools"))
    export(save / "step_000020", tmp_path / "hf")
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    loss = mean_loss(model, first_micro_batches("validation", 2))
    assert loss == pytest.approx(records[-1]["val_loss"], rel=1e-5)


@pytest.mark.parametrize(
    "layout, tied",
    [(["--pp_size", "2", "--tp_size", "2"], True), (["--dp_size", "2", "--tp_size", "2"], False)],
    ids=["pp2-tp2-tied", "dp2-tp2"],
)
def test_init_from_hf_into_a_layout(tmp_path, layout, tied):
    """A transformers checkpoint loaded slice by slice: the first step's loss (computed before
    the update) is the transformers model's loss on the same batch. Tied, the file has no
    lm_head: the last stage's copy takes the embedding's slices."""
    config = transformers.LlamaConfig(
        vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).eval()
    reference.save_pretrained(tmp_path / "hf")
    log_file = tmp_path / "log.jsonl"
    args = ["--init_from_hf", str(tmp_path / "hf"), "--seq_len", "32", "--micro_batch_size", "2"]
    args += ["--max_steps", "1", "--gradient_accumulation_steps", "2", *layout, *COMMON]
    args += ["--log_file", str(log_file)]
    check(run_step(STEP, args, nproc=4))
    dp = 2 if "--dp_size" in layout else 1
    expected = mean_loss(reference, first_micro_batches("train", 2 * dp))
    assert read_log(log_file)[0]["loss"] == pytest.approx(expected, rel=1e-5)


def test_init_from_hf_refuses_overrides(tmp_path):
    result = run_step(STEP, ["--init_from_hf", str(tmp_path), "--hidden_size", "64"])
    assert result.returncode != 0 and "no overrides" in result.stderr
