"""The data checked against the model before the first step, and nothing lost to a damaged shard.

tools/prepare_data.py records the largest token id it wrote; every step from 3 on refuses shards
and tokenizers whose ids the model's vocabulary does not hold, and a folder of shards without its
index, before it writes anything; each shard's CRC-32 is checked before its rows are served and
again when the file changes, so that a shard damaged mid-run stops the run after its last good
step, and a resume on the mended shard goes on exactly; the vocab-parallel embedding asserts the
ids that reach it.
"""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import ROOT, TINY, assert_refused, check, import_step, read_log, run_step, spawn
from steps import carriers

S3, S5 = "step3_dataloader", "step5_data_parallel_naive"
RUN = [*TINY, "--max_steps", "2", "--sample_tokens", "0", "--eval_every", "0", "--num_proc", "1"]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """tinytales as tools/prepare_data.py writes it: 3 train shards and 1 validation shard."""
    out = tmp_path_factory.mktemp("data") / "tinytales"
    tool = import_step(S3, "prepare_data")
    tool.main(["--out_dir", str(out), "--shard_tokens", "300000", "--num_proc", "1"])
    return out


@pytest.fixture
def shards(prepared, tmp_path):
    """A copy of the prepared folder that the test may damage."""
    return Path(shutil.copytree(prepared, tmp_path / "shards"))


def edit_index(folder, **fields):
    """shards.json with `fields` set, or removed where None."""
    path = folder / "shards.json"
    index = json.loads(path.read_text())
    index.update(fields)
    path.write_text(json.dumps({k: v for k, v in index.items() if v is not None}))


def model_with_vocab(tmp_path, vocab_size):
    """A --model_name folder: assets' tiny config with another vocab_size."""
    folder = tmp_path / f"vocab{vocab_size}"
    folder.mkdir()
    config = json.loads((ROOT / "assets/configs/tiny/config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": vocab_size}))
    return str(folder)


def tokenizer_with_a_gap(tmp_path, far=5000):
    """The tinytales tokenizer (ids 0 to 2047) and one more token, at id `far`: 2049 tokens."""
    folder = tmp_path / f"gap{far}"
    shutil.copytree(ROOT / "assets/tokenizers/tinytales", folder)
    config = json.loads((folder / "tokenizer.json").read_text())
    config["model"]["vocab"]["<far>"] = far
    (folder / "tokenizer.json").write_text(json.dumps(config))
    return str(folder)


def flip(path, offset=0):
    """One token's bytes inverted, in place (the same file, as a failing disk or a copy over it
    would leave it)."""
    with open(path, "r+b") as file:
        file.seek(offset)
        data = file.read(2)
        file.seek(offset)
        file.write(bytes(b ^ 0xFF for b in data))


def test_prepare_data_records_the_largest_id(prepared, tmp_path, capsys):
    """The largest id of each shard and of the folder; a shards.json written before they were
    recorded is checked and gets them, the same index as a new one."""
    tool = import_step(S3, "prepare_data")
    index = json.loads((prepared / "shards.json").read_text())
    largest = []
    for shard in (s for split in index["splits"].values() for s in split):
        tokens = np.fromfile(prepared / shard["file"], index["dtype"])
        assert shard["max_token_id"] == tokens.max(), shard["file"]
        largest.append(shard["max_token_id"])
    assert index["max_token_id"] == max(largest) == 2047
    old = Path(shutil.copytree(prepared, tmp_path / "old"))
    before = json.loads(json.dumps(index))  # a copy, its shards' records too
    del before["max_token_id"]
    for shard in (s for split in before["splits"].values() for s in split):
        del shard["max_token_id"]
    (old / "shards.json").write_text(json.dumps(before))
    capsys.readouterr()
    tool.main(["--out_dir", str(old), "--shard_tokens", "300000", "--num_proc", "1"])
    assert "recorded its largest token id, 2047" in capsys.readouterr().out
    assert json.loads((old / "shards.json").read_text()) == index


def test_prepare_data_picks_the_dtype_from_the_largest_id(tmp_path):
    """2049 tokens, the last at id 70,000: uint16 (up to 65,535) would wrap it, so uint32."""
    data = tmp_path / "stories"
    data.mkdir()
    for split in ("train", "validation"):
        (data / f"{split}.jsonl").write_text('{"text": "once upon a time"}\n')
    tool = import_step(S3, "prepare_data")
    out, tokenizer = tmp_path / "out", tokenizer_with_a_gap(tmp_path, far=70_000)
    tool.main(["--out_dir", str(out), "--dataset_name", str(data), "--tokenizer_name", tokenizer])
    index = json.loads((out / "shards.json").read_text())
    assert (index["dtype"], index["vocab_size"]) == ("uint32", 2049)


@pytest.mark.parametrize("step", carriers("dataloader.py", S3))
def test_shards_beyond_the_vocabulary_are_refused_before_the_first_step(
    step, shards, capsys, monkeypatch
):
    """The folder's record, not its tokenizer (which fits the model), is what is checked."""
    edit_index(shards, max_token_id=5000)
    message = f"--dataset_name {shards} holds token ids up to 5000 but the model's vocab_size is "
    message += "2048: it has no embedding for ids 2048 to 5000; give a --model_name whose "
    message += "vocab_size is at least 5001"
    assert_refused(step, [*RUN, "--dataset_name", str(shards)], 1, message, capsys, monkeypatch)


def test_an_index_without_the_largest_id_is_bounded_by_its_tokenizer(shards, tmp_path):
    """A shards.json from before the record: the tokenizer it was made with (its fingerprint)
    bounds its ids. A hand-edited one that is not an index says so, not a KeyError."""
    data_lib = import_step(S3, "dataloader")
    edit_index(shards, max_token_id=None)
    args = SimpleNamespace(dataset_name=str(shards), tokenizer_name="tinytales", streaming=False)
    args.seq_len, args.seed, args.num_proc = 32, 0, 1
    _, train, _ = data_lib.load_data(args, vocab_size=2048)
    assert train[[0]]["tokens"].shape == (1, 33)
    with pytest.raises(ValueError, match="holds token ids up to 2047 but the model's vocab_size"):
        data_lib.load_data(args, vocab_size=1024)
    edit_index(shards, max_token_id="2047")
    with pytest.raises(ValueError, match="its shards.json's max_token_id is not a number"):
        data_lib.load_data(args, vocab_size=2048)
    edit_index(shards, max_token_id=2047)
    index = json.loads((shards / "shards.json").read_text())
    del index["splits"]["validation"][0]["crc32"]
    (shards / "shards.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="does not list the validation split's shards with their"):
        data_lib.load_data(args, vocab_size=2048)
    (shards / "shards.json").write_text("[]")
    with pytest.raises(ValueError, match="its shards.json is not an index of shards"):
        data_lib.load_data(args, vocab_size=2048)


@pytest.mark.parametrize("step", [S3, "step4_tensor_parallel"])
@pytest.mark.parametrize("streaming", [False, True])
def test_a_tokenizer_beyond_the_vocabulary_is_refused(
    step, streaming, tmp_path, capsys, monkeypatch
):
    """Text tokenised in memory or streamed: the tokenizer's largest id, not its length, against
    the model's vocab_size (2049 tokens fit 4096; id 5000 does not)."""
    args = [*RUN, "--tokenizer_name", tokenizer_with_a_gap(tmp_path)]
    args += ["--model_name", model_with_vocab(tmp_path, 4096), *(["--streaming"] * streaming)]
    message = "the tokenizer has 2049 tokens, with ids up to 5000, but the model's vocab_size is "
    message += "4096: it has no embedding for ids 4096 to 5000"
    assert_refused(step, args, 1, message, capsys, monkeypatch)


@pytest.mark.parametrize(
    "case, message",
    [
        ("no index", "{folder} holds token shards (*.bin) but no shards.json, the index that "
         "tools/prepare_data.py writes once every shard is whole"),
        ("no index, streamed", "{folder} holds token shards (*.bin) but no shards.json"),
        ("stopped", "{folder} has no shards.json: tools/prepare_data.py was stopped before it "
         "finished (its progress.json is there); run it again with --out_dir {folder}"),
        ("the index", "{folder}/shards.json is a file of a folder of token shards; give the "
         "folder: --dataset_name {folder}"),
        ("a shard", "{folder}/train_000000.bin is a file of a folder of token shards; give the "
         "folder: --dataset_name {folder}"),
    ],
)  # fmt: skip
def test_a_folder_without_its_index_says_what_makes_it(case, message, shards, capsys, monkeypatch):
    """Not datasets' "no (supported) data files", which sends the learner looking for JSON."""
    dataset = {"the index": shards / "shards.json", "a shard": shards / "train_000000.bin"}
    if case in ("no index", "no index, streamed", "stopped"):
        (shards / "shards.json").unlink()
    if case == "stopped":
        (shards / "progress.json").write_text("{}")
    args = [*RUN, "--dataset_name", str(dataset.get(case, shards))]
    args += ["--streaming"] if case.endswith("streamed") else []
    assert_refused(S3, args, 1, message.format(folder=shards), capsys, monkeypatch)


def snapshot(folder):
    return {p.relative_to(folder): (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.rglob("*")
            if p.is_file()}  # fmt: skip


def test_a_refusal_writes_nothing(shards, tmp_path, capsys, monkeypatch):
    """A run that saved step 2, then runs refused with its --save_dir and --log_file, resumed or
    not: the checkpoint, its run.yaml and the log are as they were, to the byte and the time."""
    save, log = tmp_path / "ckpt", tmp_path / "run.jsonl"
    kept = [*RUN, "--save_dir", str(save), "--save_every", "2", "--log_file", str(log)]
    check(run_step(S3, [*kept, "--dataset_name", str(shards)]))
    before = snapshot(tmp_path / "ckpt"), log.read_bytes(), log.stat().st_mtime_ns
    no_index = tmp_path / "no_index"
    shutil.copytree(shards, no_index)
    (no_index / "shards.json").unlink()
    refused = [
        (["--dataset_name", str(shards), "--model_name", model_with_vocab(tmp_path, 1024)],
         "holds token ids up to 2047 but the model's vocab_size is 1024"),
        (["--tokenizer_name", tokenizer_with_a_gap(tmp_path), "--model_name",
          model_with_vocab(tmp_path, 4096)], "the tokenizer has 2049 tokens, with ids up to 5000"),
        (["--dataset_name", str(no_index)], "holds token shards (*.bin) but no shards.json"),
    ]  # fmt: skip
    for flags, message in refused:
        for resume in ([], ["--resume"]):
            assert_refused(S3, [*kept, *flags, *resume], 1, message, capsys, monkeypatch)
            assert (snapshot(save), log.read_bytes(), log.stat().st_mtime_ns) == before


def rows_in(index, split, seq_len):
    """A row that lies in each shard of `split`, whole: row numbers of rows of seq_len + 1."""
    rows, first = [], 0
    for shard in index["splits"][split]:
        rows.append(-(-first // (seq_len + 1)))  # the first row that starts in this shard
        first += shard["tokens"]
    return rows


def test_a_damaged_shard_is_refused_before_its_rows_are_read(shards):
    """Its rows asked for: refused, the shard named with both checksums. Other rows asked for
    first: served, and once the thread that checks ahead has found it, the next read stops."""
    data_lib = import_step(S3, "dataloader")
    index = json.loads((shards / "shards.json").read_text())
    first, second, _ = rows_in(index, "train", 31)
    flip(shards / "train_000001.bin", offset=1000)
    rows = data_lib.TokenShards(shards, index, "train", 31)
    with pytest.raises(
        ValueError, match=r"train_000001.bin is damaged: its CRC-32 is [0-9a-f]{8}, "
    ):
        rows[[second]]
    rows = data_lib.TokenShards(shards, index, "train", 31)
    assert rows[[first]]["tokens"].shape == (1, 32)
    rows.checker.join()
    with pytest.raises(ValueError, match="train_000001.bin is damaged"):
        rows[[first]]


def test_a_shard_changed_after_its_check_is_checked_again(shards):
    """A shard read whole, then damaged in place, cut short: its next read is refused; mended,
    it serves the same rows again. A shard replaced by another file (a new inode) is read from
    the file that was checked."""
    data_lib = import_step(S3, "dataloader")
    index = json.loads((shards / "shards.json").read_text())
    _, second, third = rows_in(index, "train", 31)
    rows = data_lib.TokenShards(shards, index, "train", 31)
    whole = rows[[second, third]]["tokens"]
    good = (shards / "train_000001.bin").read_bytes()
    flip(shards / "train_000001.bin", offset=len(good) - 2)  # far from the rows read
    with pytest.raises(ValueError, match="train_000001.bin is damaged"):
        rows[[second]]
    assert torch.equal(rows[[third]]["tokens"], whole[1:])  # the other shards still serve
    with open(shards / "train_000001.bin", "r+b") as file:
        file.write(good)
    assert torch.equal(rows[[second, third]]["tokens"], whole)
    with open(shards / "train_000001.bin", "r+b") as file:
        file.truncate(len(good) // 2)
    with pytest.raises(ValueError, match="train_000001.bin is damaged"):
        rows[[second]]
    (shards / "train_000001.bin").write_bytes(good)  # the same inode again, whole
    moved = shards / "elsewhere.bin"
    (shards / "train_000001.bin").rename(moved)
    (shards / "train_000001.bin").write_bytes(b"\0" * len(good))  # another file at that name
    assert torch.equal(rows[[second, third]]["tokens"], whole)


def test_a_shard_changed_while_a_row_is_read_is_checked_again(shards, monkeypatch):
    """Damaged between its check and the read of a row: the row is read again after a check,
    which refuses it, rather than served as read."""
    data_lib = import_step(S3, "dataloader")
    index = json.loads((shards / "shards.json").read_text())
    _, second, _ = rows_in(index, "train", 31)
    rows = data_lib.TokenShards(shards, index, "train", 31)
    rows.shards[1].check()
    pread = data_lib.os.pread

    def damage_first(fd, size, offset):
        if size != data_lib.CHECK_BYTES:  # a row's read, not a checksum's
            flip(shards / "train_000001.bin", offset)
            monkeypatch.setattr(data_lib.os, "pread", pread)
        return pread(fd, size, offset)

    monkeypatch.setattr(data_lib.os, "pread", damage_first)
    with pytest.raises(ValueError, match="train_000001.bin is damaged"):
        rows[[second]]


DAMAGE = """
import os, runpy, sys
sys.path.insert(0, {step!r})
import dataloader

serve = dataloader.MicroBatchDataLoader.__next__


def damage_then_serve(self):
    # On rank 0, as the training rows from position {position} are about to be read: the shard
    # of the first of them damaged in place, and its name written down for the test.
    if self.shuffle and self.position == {position} and os.environ.get("RANK", "0") == "0":
        token = self.index(self.position) * self.rows.row
        shard = next(s for s in self.rows.shards if s.first <= token < s.first + s.tokens)
        offset = (token - shard.first) * self.rows.dtype.itemsize
        with open(shard.path, "r+b") as file:
            file.seek(offset)
            data = file.read(2)
            file.seek(offset)
            file.write(bytes(b ^ 0xFF for b in data))
        with open({note!r}, "w") as file:
            file.write(shard.path.name)
    return serve(self)


dataloader.MicroBatchDataLoader.__next__ = damage_then_serve
sys.argv = [{train!r}, *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("step, dp", [(S3, 1), (S5, 2)])
def test_a_shard_damaged_mid_run_loses_nothing_and_resumes_exactly(
    step, dp, prepared, shards, tmp_path
):
    """6 steps straight; then a run saving every step whose shard of step 4's first row is
    damaged as step 4 reads it (on rank 0): it stops with the shard's name, its log and its
    checkpoints end at step 3; the shard put back, --resume logs what the straight run logged.
    At dp 2 the other rank, which read its rows before the damage, is in step 4's all-reduce when
    rank 0 exits: it has lost its peer, and waits for rank 0's line to come first (run_main): one
    line, no traceback, at any dp."""
    flags = [*TINY, "--dataset_name", str(shards), "--eval_every", "3", "--eval_steps", "2"]
    flags += ["--sample_tokens", "0", "--max_steps", "6", "--dp_size", str(dp)]
    straight, damaged, resumed = (tmp_path / f"{n}.jsonl" for n in ("straight", "cut", "resumed"))
    check(run_step(step, [*flags, "--log_file", str(straight)], nproc=dp))
    note, script = tmp_path / "damaged.txt", tmp_path / "damage.py"
    script.write_text(
        DAMAGE.format(
            step=str(ROOT / step),
            train=str(ROOT / step / "train.py"),
            position=3 * 2 * dp,  # three steps of 2 rows on each dp rank
            note=str(note),
        )
    )
    save = ["--save_dir", str(tmp_path / "ckpt"), "--save_every", "1"]
    result = run_step(step, [*flags, *save, "--log_file", str(damaged)], nproc=dp, script=script)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-2000:]
    assert f"error: {shards / note.read_text()} is damaged: its CRC-32 is" in output, output
    assert output.count(" is damaged: ") == 1, output[-2000:]
    assert "Traceback" not in output, output[-2000:]
    assert [r["step"] for r in read_log(damaged)] == [1, 2, 3]
    checkpoints = sorted(p.name for p in (tmp_path / "ckpt").glob("step_*"))
    assert checkpoints == ["step_000001", "step_000002", "step_000003"]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_000003"
    shutil.copyfile(prepared / note.read_text(), shards / note.read_text())
    check(run_step(step, [*flags, *save, "--resume", "--log_file", str(resumed)], nproc=dp))
    keys = ["step", "loss", "grad_norm", "tokens", "val_loss"]
    expected = [{k: r.get(k) for k in keys} for r in read_log(straight)[3:]]
    assert [{k: r.get(k) for k in keys} for r in read_log(resumed)] == expected


def distinct_copies(file, folder):
    """The steps that carry `file`, one per distinct content: identical copies behave alike."""
    seen = {}
    for step in carriers(file, folder):
        seen.setdefault((ROOT / step / file).read_bytes(), step)
    return list(seen.values())


def embedding_worker(rank, world):
    import tensor_parallel  # the step's own: spawn puts its folder first

    vocab = 40
    embed = tensor_parallel.VocabParallelEmbedding(vocab, 8, dist.group.WORLD)
    torch.nn.init.normal_(embed.weight)
    # No read of a tensor's value on the host (on a GPU each one waits for the device), which an
    # `assert` or an `if` on the ids would be.
    reads, originals = [], {n: getattr(torch.Tensor, n) for n in ("__bool__", "item", "tolist")}
    for name, original in originals.items():
        setattr(torch.Tensor, name, lambda t, *a, f=original, n=name: reads.append(n) or f(t, *a))
    try:
        inside = embed(torch.tensor([[0, vocab - 1]]))
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    assert reads == [], reads
    assert inside.abs().sum() > 0  # looked up, no assertion
    for outside in (vocab, -1):
        with pytest.raises(RuntimeError, match="a token id outside the model's vocabulary"):
            embed(torch.tensor([[3, outside]]))


@pytest.mark.parametrize("step", distinct_copies("tensor_parallel.py", "step4_tensor_parallel"))
def test_the_embedding_asserts_ids_outside_the_vocabulary_on_every_rank(step, tmp_path):
    """At tp 2 an id that no rank holds would be a zero vector on both: each rank asserts, on
    the device (torch._assert_async), without reading the ids on the host."""
    spawn(step, embedding_worker, 2, tmp_path)
