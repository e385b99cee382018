"""Step 3's data pipeline: rows, the shift by one, determinism, wrap-around, offline defaults."""

import gc

import datasets
import pytest
import torch
from conftest import ROOT, import_step
from datasets import Dataset

data_lib = import_step("step3_dataloader", "dataloader")


@pytest.fixture(scope="module")
def tokenizer():
    return data_lib.load_tokenizer("tinytales")


def small_rows(n=10, length=5):
    """Rows whose tokens say which row they are: row i holds i*100 + 0..length-1."""
    tokens = [[i * 100 + j for j in range(length)] for i in range(n)]
    return Dataset.from_dict({"tokens": tokens}).with_format("torch")


def test_offline_defaults_load():
    tokenizer = data_lib.load_tokenizer("tinytales")
    assert len(tokenizer) == 2048 and tokenizer.eos_token == "<|endoftext|>"
    train, validation = data_lib.load_splits("tinytales", seed=0)
    assert len(train) > 5000 and len(validation) > 100
    assert train[0]["text"] != validation[0]["text"]


def test_unreachable_hub_names_the_local_default():
    with pytest.raises(ValueError, match="offline default is 'tinytales'"):
        data_lib.load_tokenizer("no-such-user/no-such-tokenizer")
    with pytest.raises(ValueError, match="offline default is 'tinytales'"):
        data_lib.load_splits("no-such-user/no-such-dataset", seed=0)


def test_a_local_dataset_that_does_not_load_names_its_cause(tmp_path):
    """A folder that exists is not blamed on the hub: the message gives datasets' error and the
    one that caused it, here the JSON parser's."""
    (tmp_path / "train.jsonl").write_text("not json\n")
    with pytest.raises(ValueError) as refusal:
        data_lib.load_splits(str(tmp_path), seed=0)
    assert "not a local path" not in str(refusal.value)
    assert f"from {tmp_path} (DatasetGenerationError: " in str(refusal.value)
    assert "; ArrowInvalid: JSON parse error: Invalid value. in row 0)" in str(refusal.value)


def test_the_rows_do_not_depend_on_num_proc(tmp_path, tokenizer):
    """The processes tokenise, the stream is cut in one pass: --num_proc 1 and 2 give the same
    rows, and datasets' cache (which leaves num_proc out of its key) may serve either."""
    lines = (ROOT / "assets/datasets/tinytales/train.jsonl").read_text().splitlines()
    (tmp_path / "train.jsonl").write_text("\n".join(lines[:1500]) + "\n")
    train, _ = data_lib.load_splits(str(tmp_path), seed=0)
    # datasets forks its workers from this process, which earlier tests have filled: garbage
    # left by them and collected in a forked worker crashed it (a segmentation fault inside the
    # collection). Collected here first, and what is left is kept out of the workers' collections.
    gc.collect()
    gc.freeze()
    datasets.disable_caching()
    try:
        one = data_lib.tokenize(train, tokenizer, 64, num_proc=1)[:]["tokens"]
        two = data_lib.tokenize(train, tokenizer, 64, num_proc=2)[:]["tokens"]
    finally:
        datasets.enable_caching()
        gc.unfreeze()
    assert one.shape == two.shape and torch.equal(one, two)


def test_rows_are_documents_joined_by_eos(tokenizer):
    """The documents' tokens, each followed by end-of-text, cut into rows: across the batches of
    1,000 documents that are tokenised together, only the stream's last partial row dropped."""
    docs = Dataset.from_dict({"text": ["The cat sat.", "A dog ran far away.", "Sun."] * 800})
    rows = data_lib.tokenize(docs, tokenizer, seq_len=7, num_proc=1)
    tokens = rows[:]["tokens"]  # (rows, T+1)
    assert tokens.shape[1] == 8
    stream = []
    for text in docs["text"]:
        stream += tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    flat = tokens.flatten().tolist()
    assert flat == stream[: len(flat)]
    assert len(stream) - len(flat) < 8


def test_targets_are_inputs_shifted_by_one():
    loader = data_lib.MicroBatchDataLoader(small_rows(), 3, seed=0, device="cpu")
    inputs, targets = next(loader)
    assert inputs.shape == targets.shape == (3, 4)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert torch.equal(targets - inputs, torch.ones_like(inputs))


def batches(loader, n):
    return [next(loader)[0] for _ in range(n)]


def test_deterministic_for_a_seed():
    a = batches(data_lib.MicroBatchDataLoader(small_rows(), 2, seed=1, device="cpu"), 8)
    b = batches(data_lib.MicroBatchDataLoader(small_rows(), 2, seed=1, device="cpu"), 8)
    c = batches(data_lib.MicroBatchDataLoader(small_rows(), 2, seed=2, device="cpu"), 8)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))


def test_wraps_into_new_epochs_covering_every_row_once():
    loader = data_lib.MicroBatchDataLoader(small_rows(), 4, seed=0, device="cpu")
    firsts = torch.cat(batches(loader, 10))[:, 0] // 100  # 40 rows: four epochs of 10
    assert loader.epoch == 4
    epochs = firsts.view(4, 10)
    for epoch in epochs:
        assert sorted(epoch.tolist()) == list(range(10))
    assert not torch.equal(epochs[0], epochs[1])  # a new order every epoch


def test_resumes_from_its_position():
    loader = data_lib.MicroBatchDataLoader(small_rows(), 3, seed=5, device="cpu")
    batches(loader, 5)
    state = loader.state_dict()
    expected = batches(loader, 6)
    again = data_lib.MicroBatchDataLoader(small_rows(), 3, seed=5, device="cpu")
    again.load_state_dict(state)
    assert all(torch.equal(x, y) for x, y in zip(expected, batches(again, 6), strict=True))


def test_resuming_other_rows_says_so(capsys):
    """A checkpoint of data cut into 10 rows, resumed on 12 (another --seq_len, say): the
    position is kept and the run says that the data does not go on where it stopped."""
    loader = data_lib.MicroBatchDataLoader(small_rows(), 3, seed=5, device="cpu")
    batches(loader, 2)
    same = data_lib.MicroBatchDataLoader(small_rows(), 3, seed=5, device="cpu")
    same.load_state_dict(loader.state_dict())
    assert capsys.readouterr().out == ""
    other = data_lib.MicroBatchDataLoader(small_rows(12), 3, seed=5, device="cpu")
    other.load_state_dict(loader.state_dict())
    assert other.position == 6
    assert (
        "warning: the checkpoint's data had 10 rows and this run's has 12"
        in capsys.readouterr().out
    )


def test_too_small_dataset_is_refused(tokenizer):
    docs = Dataset.from_dict({"text": ["Hi."]})
    with pytest.raises(ValueError, match="too small for one row"):
        data_lib.tokenize(docs, tokenizer, seq_len=512, num_proc=1)


def test_assets_are_where_the_defaults_point():
    assert (ROOT / "assets/datasets/tinytales/train.jsonl").is_file()
    assert (ROOT / "assets/tokenizers/tinytales/tokenizer.json").is_file()
    assert (ROOT / "assets/configs/tiny/config.json").is_file()


def test_data_that_cannot_train_is_refused_naming_why(tmp_path, tokenizer):
    """A text column of numbers, and documents that are all empty, are refused before any step."""
    numbers = tmp_path / "numbers"
    numbers.mkdir()
    (numbers / "train.jsonl").write_text('{"text": 1}\n{"text": 2}\n')
    (numbers / "validation.jsonl").write_text('{"text": 3}\n')
    with pytest.raises(ValueError, match=r"the train split's 'text' column holds Value\('int64'\)"):
        data_lib.load_splits(str(numbers), seed=0)
    empty = Dataset.from_dict({"text": [""] * 100})
    with pytest.raises(ValueError, match="documents are all empty: its rows hold end-of-text only"):
        data_lib.tokenize(empty, tokenizer, seq_len=8, num_proc=1)
    some = Dataset.from_dict({"text": ["Once upon a time"] + [""] * 99})
    assert len(data_lib.tokenize(some, tokenizer, seq_len=8, num_proc=1)) > 0
