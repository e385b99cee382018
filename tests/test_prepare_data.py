"""Token shards: tools/prepare_data.py writes them, step 3's loader reads its rows from them.

The shards hold exactly the tokenizer's output, documents joined by end-of-text, whatever the
number of processes; a stopped preparation goes on to the same bytes; the trainer cuts the same
rows from them as from the stream, covers each once per epoch under dp and cp, resumes exactly,
and refuses shards of another tokenizer, cut short, missing or extra.
"""

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import TINY, check, import_step, read_log, run_step

S3 = "step3_dataloader"
SMALL = ["--shard_tokens", "300000"]  # tinytales' 938,200 training tokens in 3 shards


def prepare(out, *flags):
    """tools/prepare_data.py in this process; the exit status (0 when it returns)."""
    tool = import_step(S3, "prepare_data")
    try:
        tool.main(["--out_dir", str(out), *SMALL, *flags])
    except SystemExit as exit:
        return exit.code
    return 0


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """tinytales prepared with one process and with two."""
    tmp = tmp_path_factory.mktemp("shards")
    for n in (1, 2):
        assert prepare(tmp / f"proc{n}", "--num_proc", str(n)) == 0
    return tmp


def stream(folder, split):
    index = json.loads((folder / "shards.json").read_text())
    parts = [np.fromfile(folder / s["file"], dtype=index["dtype"]) for s in index["splits"][split]]
    return np.concatenate(parts).astype(np.int64), index


def test_shards_hold_the_tokenizers_output_whatever_the_processes(shards):
    data_lib = import_step(S3, "dataloader")
    tokenizer = data_lib.load_tokenizer("tinytales")
    train, validation = data_lib.load_splits("tinytales", seed=42)  # the trainer's split
    for split, documents in [("train", train), ("validation", validation)]:
        ids = tokenizer(list(documents["text"]), add_special_tokens=False)["input_ids"]
        expected = [t for doc in ids for t in (*doc, tokenizer.eos_token_id)]
        tokens, index = stream(shards / "proc1", split)
        assert tokens.tolist() == expected, split
        assert (tokens == tokenizer.eos_token_id).sum() == len(documents)  # boundaries kept
        assert np.array_equal(stream(shards / "proc2", split)[0], tokens)
    assert index["dtype"] == "uint16" and index["vocab_size"] == 2048
    assert len(index["splits"]["train"]) == 3
    for file in (shards / "proc1").iterdir():
        assert file.read_bytes() == (shards / "proc2" / file.name).read_bytes(), file.name


def test_a_stopped_preparation_goes_on_to_the_same_bytes(shards, tmp_path, monkeypatch, capsys):
    tool = import_step(S3, "prepare_data")
    write_shard, written = tool.write_shard, []

    def crash_after_two(*args):
        if len(written) == 2:
            raise KeyboardInterrupt  # the job killed while tokenising the third shard
        written.append(write_shard(*args))

    monkeypatch.setattr(tool, "write_shard", crash_after_two)
    with pytest.raises(KeyboardInterrupt):
        tool.main(["--out_dir", str(tmp_path / "out"), *SMALL, "--num_proc", "1"])
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "progress.json",
        "train_000000.bin",
        "train_000001.bin",
    ]
    progress = json.loads((tmp_path / "out" / "progress.json").read_text())
    for shard in progress["splits"]["train"]["shards"]:
        del shard["max_token_id"]  # as a run stopped before their largest ids were recorded
    (tmp_path / "out" / "progress.json").write_text(json.dumps(progress))
    monkeypatch.undo()
    assert prepare(tmp_path / "out", "--num_proc", "2") == 0
    for file in (shards / "proc1").iterdir():
        assert (tmp_path / "out" / file.name).read_bytes() == file.read_bytes(), file.name
    assert not (tmp_path / "out" / "progress.json").exists()
    capsys.readouterr()
    assert prepare(tmp_path / "out") == 0  # finished: checked and left alone
    assert "is finished and whole: nothing to do" in capsys.readouterr().out
    (tmp_path / "out" / "train_000001.bin").write_bytes(b"\0" * 10)
    assert prepare(tmp_path / "out") == 2
    assert "train_000001.bin is missing or not what shards.json says" in capsys.readouterr().err
    assert prepare(tmp_path / "out", "--seed", "1") == 2
    assert "made with other settings (seed differ)" in capsys.readouterr().err


def test_prepare_data_refuses_what_it_cannot_write(tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    assert prepare(tmp_path / "full") == 2
    assert "--out_dir" in capsys.readouterr().err
    data = tmp_path / "numbers"
    data.mkdir()
    (data / "train.jsonl").write_text('{"text": "a story"}\n{"text": 7}\n')
    (data / "validation.jsonl").write_text('{"text": "a story"}\n')
    assert prepare(tmp_path / "out", "--dataset_name", str(data), "--streaming") == 2
    assert "the train split's document 1 has no text in a 'text' column" in capsys.readouterr().err


def test_rows_are_the_stream_cut_in_order_across_shard_ends(shards):
    data_lib = import_step(S3, "dataloader")
    tokens, index = stream(shards / "proc1", "train")
    rows = data_lib.TokenShards(shards / "proc1", index, "train", seq_len=255)
    assert len(rows) == len(tokens) // 256
    first_end = index["splits"]["train"][0]["tokens"]
    across = first_end // 256  # the row the first shard's end cuts
    assert first_end % 256, "no row crosses the end of the first shard: pick another seq_len"
    for i in [0, across - 1, across, len(rows) - 1]:
        assert rows[[i]]["tokens"].tolist() == [tokens[i * 256 : (i + 1) * 256].tolist()], i
    batch = rows[[3, across, 1]]["tokens"]
    assert batch.shape == (3, 256) and batch.dtype == torch.int64


def test_the_shards_rows_are_the_rows_tokenised_in_memory(shards):
    """The same corpus, tokenizer and seq_len: the trainer's in-memory rows (tokenised at its
    start) and the rows of the prepared shards are the same, row by row, in both splits."""
    data_lib = import_step(S3, "dataloader")
    tokenizer = data_lib.load_tokenizer("tinytales")
    index = json.loads((shards / "proc1" / "shards.json").read_text())
    for split, documents in zip(
        ["train", "validation"], data_lib.load_splits("tinytales", 42), strict=True
    ):
        in_memory = data_lib.tokenize(documents, tokenizer, 255, num_proc=1)
        from_shards = data_lib.TokenShards(shards / "proc1", index, split, seq_len=255)
        assert len(in_memory) == len(from_shards), split
        every = list(range(len(from_shards)))
        assert torch.equal(in_memory[every]["tokens"], from_shards[every]["tokens"]), split


def test_dp_and_cp_ranks_read_every_row_once_per_epoch(shards):
    data_lib = import_step("step11_context_parallel", "dataloader")
    index = json.loads((shards / "proc1" / "shards.json").read_text())
    rows = data_lib.TokenShards(shards / "proc1", index, "validation", seq_len=64)
    n = len(rows)  # 362 rows: an epoch is 181 steps of 2 dp ranks x 1 row
    assert n % 2 == 0
    seen = []
    for dp_rank in range(2):
        parts = []
        for cp_rank in range(2):
            loader = data_lib.MicroBatchDataLoader(rows, 1, 0, "cpu", True, dp_rank, 2, cp_rank, 2)
            parts.append([next(loader) for _ in range(n // 2)])
        for (in0, tg0), (in1, tg1) in zip(*parts, strict=True):
            inputs = torch.cat([in0[:, :16], in1, in0[:, 16:]], dim=1)  # chunks 0 | 1, 2 | 3
            targets = torch.cat([tg0[:, :16], tg1, tg0[:, 16:]], dim=1)
            assert torch.equal(inputs[:, 1:], targets[:, :-1])
            seen += [tuple(row) for row in torch.cat([inputs, targets[:, -1:]], 1).tolist()]
    everything = [tuple(row) for row in rows[range(n)]["tokens"].tolist()]
    assert sorted(seen) == sorted(everything)


def test_the_trainer_refuses_shards_it_cannot_use(shards, tmp_path):
    data_lib = import_step(S3, "dataloader")
    tokenizer = data_lib.load_tokenizer("tinytales")
    folder = tmp_path / "copy"
    shutil.copytree(shards / "proc1", folder)
    read = lambda: data_lib.read_shard_index(folder, tokenizer, "mine")  # noqa: E731
    read()  # whole: no refusal
    other = tmp_path / "other_tokenizer"
    shutil.copytree(data_lib.resolve("tinytales", "tokenizers"), other)
    config = json.loads((other / "tokenizer.json").read_text())
    config["added_tokens"].append({**config["added_tokens"][-1], "id": 2048, "content": "<x>"})
    (other / "tokenizer.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"tokenised with 'tinytales' \(2048 tokens\), not with "):
        data_lib.read_shard_index(folder, data_lib.load_tokenizer(str(other)), str(other))
    (folder / "train_000009.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="train_000009.bin is not in its shards.json"):
        read()
    (folder / "train_000009.bin").unlink()
    with open(folder / "train_000002.bin", "r+b") as file:
        file.truncate(1000)
    with pytest.raises(
        ValueError, match="train_000002.bin holds 1,000 bytes, but shards.json says"
    ):
        read()
    (folder / "train_000002.bin").unlink()
    with pytest.raises(ValueError, match="train_000002.bin is missing, but shards.json says"):
        read()
    index = json.loads((folder / "shards.json").read_text())
    (folder / "shards.json").write_text(json.dumps({**index, "dtype": "uint8"}))
    with pytest.raises(ValueError, match="its shards.json names dtype 'uint8'"):
        read()
    args = SimpleNamespace(dataset_name=str(shards / "proc1"), streaming=True)
    args.tokenizer_name = "tinytales"
    with pytest.raises(ValueError, match="is a folder of token shards, .* drop --streaming"):
        data_lib.load_data(args, vocab_size=2048)


def test_a_run_on_shards_resumes_exactly(shards, tmp_path):
    """Step 3 on the shards at dp 2: 6 steps straight, and 3 + resume + 3, log the same."""
    flags = [*TINY, "--dataset_name", str(shards / "proc1"), "--eval_every", "3"]
    flags += ["--eval_steps", "2", "--sample_tokens", "0", "--dp_size", "2", "--max_steps", "6"]
    straight, resumed = tmp_path / "straight.jsonl", tmp_path / "resumed.jsonl"
    check(run_step(S3, [*flags, "--log_file", str(straight)], nproc=2))
    save = ["--save_dir", str(tmp_path / "ckpt"), "--save_every", "3"]
    check(run_step(S3, [*flags, *save, "--log_file", str(tmp_path / "first.jsonl")], nproc=2))
    (tmp_path / "ckpt" / "latest").write_text("step_000003")
    result = check(run_step(S3, [*flags, *save, "--resume", "--log_file", str(resumed)], nproc=2))
    assert "training rows" in result.stdout
    keys = ["loss", "grad_norm", "tokens", "val_loss"]
    expected = [{k: r.get(k) for k in keys} for r in read_log(straight)[3:]]
    assert [{k: r.get(k) for k in keys} for r in read_log(resumed)] == expected


def test_streamed_rows_are_the_shards_rows_in_order_and_wrap(shards):
    """--streaming cuts the stream as the shards do: the same rows, in the stream's order; past
    its end the rows start again, and a row asked again (a resume) is read again, the same."""
    data_lib = import_step(S3, "dataloader")
    tokenizer = data_lib.load_tokenizer("tinytales")
    index = json.loads((shards / "proc1" / "shards.json").read_text())
    expected = data_lib.TokenShards(shards / "proc1", index, "validation", seq_len=64)
    n = len(expected)
    rows = data_lib.StreamedRows("tinytales", "validation", tokenizer, seq_len=64)
    assert torch.equal(rows[range(n)]["tokens"], expected[range(n)]["tokens"])
    assert rows.length is None  # the end not reached yet: the next row is n, the first again
    assert torch.equal(rows[[n, n + 1]]["tokens"], expected[[0, 1]]["tokens"])
    assert rows.length == n
    assert torch.equal(rows[[5]]["tokens"], expected[[5]]["tokens"])  # back: read again


def test_a_stream_without_validation_holds_out_every_100th_document(tmp_path):
    data_lib = import_step(S3, "dataloader")
    folder = tmp_path / "stories"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(f'{{"text": "story {i}"}}\n' for i in range(300)))
    held_out = list(data_lib.open_stream(str(folder), "validation"))
    assert held_out == ["story 99", "story 199", "story 299"]
    assert len(list(data_lib.open_stream(str(folder), "train"))) == 297


def test_a_streamed_run_at_dp2_resumes_exactly(tmp_path):
    """Step 5 streams tinytales at dp 2: each rank reads the stream and keeps its rows; 6 steps
    straight and 3 + resume + 3 (the stream read again up to the saved position) log the same."""
    flags = [*TINY, "--streaming", "--eval_every", "3", "--eval_steps", "2", "--num_proc", "1"]
    flags += ["--sample_tokens", "0", "--dp_size", "2", "--max_steps", "6"]
    step = "step5_data_parallel_naive"
    straight, resumed = tmp_path / "straight.jsonl", tmp_path / "resumed.jsonl"
    result = check(run_step(step, [*flags, "--log_file", str(straight)], nproc=2))
    assert "streamed, its rows tokenised as they are served" in result.stdout
    save = ["--save_dir", str(tmp_path / "ckpt"), "--save_every", "3"]
    check(run_step(step, [*flags, *save, "--log_file", str(tmp_path / "first.jsonl")], nproc=2))
    (tmp_path / "ckpt" / "latest").write_text("step_000003")
    check(run_step(step, [*flags, *save, "--resume", "--log_file", str(resumed)], nproc=2))
    keys = ["loss", "grad_norm", "tokens", "val_loss"]
    expected = [{k: r.get(k) for k in keys} for r in read_log(straight)[3:]]
    assert [{k: r.get(k) for k in keys} for r in read_log(resumed)] == expected
