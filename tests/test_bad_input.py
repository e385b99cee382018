"""Bad input is refused before training with one line: `error: ...`, naming the bad value and what
would work, exit status 2, no traceback, promptly on every rank.

Most kinds run in this process (`train.main` through `utils.run_main`, as `python train.py` does),
which costs no start-up; a few run as real processes, alone and under torchrun, where the message
must also be printed once and torchrun must stop the other ranks.
"""

import json
import sys
import time

import pytest
import torch
from conftest import ROOT, TINY, exit_here, import_step, run_in_process, run_step
from safetensors.torch import save_file

RUN = ["--max_steps", "2", "--num_proc", "1", "--sample_tokens", "4", "--eval_steps", "1"]
ARGS = [*TINY, *RUN]
NO_SHAPE = [*TINY[10:], *RUN]  # without the model overrides, which --init_from_hf refuses
TIME_LIMIT = 30  # seconds, from the call to the exit
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Folders and files for the path cases: a small dataset, configs, damaged checkpoints."""
    tmp = tmp_path_factory.mktemp("bad")
    data = tmp / "stories"
    data.mkdir()
    lines = (ROOT / "assets/datasets/tinytales/train.jsonl").read_text().splitlines()
    (data / "train.jsonl").write_text("\n".join(lines[:40]) + "\n")
    (data / "validation.jsonl").write_text("\n".join(lines[40:45]) + "\n")
    config = json.loads((ROOT / "assets/configs/tiny/config.json").read_text())
    for name, change in [("gpt2", {"model_type": "gpt2"}), ("small_vocab", {"vocab_size": 1000})]:
        (tmp / name).mkdir()
        (tmp / name / "config.json").write_text(json.dumps({**config, **change}))
    (tmp / "a_file").write_text("not a folder")
    # A tokenizer folder whose tokenizer.json is cut short.
    (tmp / "badtok").mkdir()
    for file in (ROOT / "assets/tokenizers/tinytales").iterdir():
        (tmp / "badtok" / file.name).write_bytes(file.read_bytes())
    (tmp / "badtok" / "tokenizer.json").write_text('{"version": "1.0", "trunc')
    (tmp / "a_folder").mkdir()
    (tmp / "no_config").mkdir()
    (tmp / "no_weights").mkdir()
    (tmp / "no_weights" / "config.json").write_text(json.dumps(config))
    weights = tmp / "weights.safetensors"
    save_file({"x": torch.zeros(4)}, str(weights))
    # --init_from_hf folders that pass the first checks (a config.json and weights) but whose
    # config is another model's, or not JSON.
    for name, text in [("hf_gpt2", json.dumps({"model_type": "gpt2"})), ("hf_broken", "{x")]:
        (tmp / name).mkdir()
        (tmp / name / "config.json").write_text(text)
        (tmp / name / "model.safetensors").write_bytes(weights.read_bytes())
    torch.save({"step": 1}, tmp / "state.pt")
    # Step 3's checkpoints: a truncated weight file; a missing trainer state; a latest pointing
    # nowhere. Only the files' headers are read before the refusal, so any tensor will do.
    checkpoints = {
        "truncated": {"model.safetensors": weights.read_bytes()[:50], "trainer_state.pt": None},
        "missing": {"model.safetensors": weights.read_bytes()},
        "nowhere": None,
    }
    for name, contents in checkpoints.items():
        folder = tmp / f"ckpt_{name}"
        folder.mkdir()
        (folder / "latest").write_text("step_000001")
        if contents is None:
            continue
        (folder / "step_000001").mkdir()
        for file, blob in contents.items():
            blob = (tmp / "state.pt").read_bytes() if blob is None else blob
            (folder / "step_000001" / file).write_bytes(blob)
    # Complete checkpoints of the tiny config's own shape (256 wide, 4 layers), which the test
    # runs (64 wide, 2 layers) must not resume from: step 3's files, and step 8's at pp 1.
    for name, shard in [("ckpt_other", ""), ("ckpt_other_pp", "-pp0-of-1-tp0-of-1")]:
        folder = tmp / name / "step_000001"
        folder.mkdir(parents=True)
        (folder.parent / "latest").write_text("step_000001")
        (folder / "config.json").write_text(json.dumps(config))
        (folder / f"model{shard}.safetensors").write_bytes(weights.read_bytes())
        (folder / f"trainer_state{shard}.pt").write_bytes((tmp / "state.pt").read_bytes())
    # Step 3's checkpoint whose config.json was cut short (its other files pass their checks).
    folder = tmp / "ckpt_badconfig" / "step_000001"
    folder.mkdir(parents=True)
    (folder.parent / "latest").write_text("step_000001")
    (folder / "config.json").write_text(json.dumps(config)[:100])
    (folder / "model.safetensors").write_bytes(weights.read_bytes())
    (folder / "trainer_state.pt").write_bytes((tmp / "state.pt").read_bytes())
    # Step 8 at pp 2: stage 1's weights truncated; stage 0 (rank 0's own) complete.
    pp = tmp / "ckpt_pp" / "step_000001"
    pp.mkdir(parents=True)
    (pp.parent / "latest").write_text("step_000001")
    for stage in range(2):
        (pp / f"trainer_state-pp{stage}-of-2-tp0-of-1.pt").write_bytes(
            (tmp / "state.pt").read_bytes()
        )
        (pp / f"model-pp{stage}-of-2-tp0-of-1.safetensors").write_bytes(weights.read_bytes())
    with open(pp / "model-pp1-of-2-tp0-of-1.safetensors", "r+b") as f:
        f.truncate(60)
    # Run files (--config) with a key that is no flag, a value of the wrong type, a list.
    runs = {"unknown.yaml": "seq_len: 32\nsequence_length: 8\n", "wrong.yaml": "seq_len: long\n"}
    runs |= {"list.yaml": "- seq_len\n", "flag.json": '{"compile": "yes"}', "bad.json": "{x"}
    runs |= {"choice.yaml": "lr_schedule: linear\n", "nested.yaml": "seq_len: [32, 64]\n"}
    for name, text in runs.items():
        (tmp / name).write_text(text)
    (tmp / "numbers").mkdir()  # a dataset whose text column holds numbers
    (tmp / "numbers" / "train.jsonl").write_text('{"text": 1}\n')
    (tmp / "numbers" / "validation.jsonl").write_text('{"text": 2}\n')
    return tmp


# (step, arguments, what the message must say); {tmp} is the `files` folder.
S3, S4, S6 = "step3_dataloader", "step4_tensor_parallel", "step6_data_parallel_bucket"
S8, S9 = "step8_pipeline_parallel_1f1b", "step9_3d_parallel"
CASES = [
    (S3, "--seq_len abc", "argument --seq_len: invalid int value: 'abc'"),
    (S3, "--sequence_length 8", "unrecognized arguments: --sequence_length"),
    (S3, "--micro_batch_size 0", "--micro_batch_size must be at least 1, got 0"),
    (S3, "--learning_rate -0.1", "--learning_rate must be above 0, got -0.1"),
    (S3, "--warmup_steps -1", "--warmup_steps must be 0 or more, got -1"),
    (S3, "--eval_every -5", "--eval_every must be 0 or more, got -5"),
    (S3, "--decay_fraction 0", "--decay_fraction must be above 0 and at most 1, got 0.0"),
    (S3, "--lr_schedule linear", "argument --lr_schedule: invalid choice: 'linear'"),
    (S3, "--early_stopping_patience -1", "--early_stopping_patience must be 0 or more, got -1"),
    (
        S3,
        "--early_stopping_patience 2 --eval_every 0",
        "--early_stopping_patience counts validations: it needs --eval_every above 0",
    ),
    (S3, "--config {tmp}/none.yaml", "--config {tmp}/none.yaml cannot be read: No such file"),
    (S3, "--config {tmp}/unknown.yaml", "{tmp}/unknown.yaml: 'sequence_length' is not a flag"),
    (S3, "--config {tmp}/wrong.yaml", "{tmp}/wrong.yaml: seq_len must be of type int, got 'long'"),
    (S3, "--config {tmp}/list.yaml", "{tmp}/list.yaml must map flag names to values"),
    (S3, "--config {tmp}/flag.json", "{tmp}/flag.json: compile must be true or false, got 'yes'"),
    (S3, "--config {tmp}/bad.json", "--config {tmp}/bad.json is not valid JSON"),
    (S3, "--config {tmp}/choice.yaml", "lr_schedule must be one of cosine, wsd, got 'linear'"),
    (S3, "--config {tmp}/nested.yaml", "seq_len must be one value of the flag's type, got [32"),
    (S4, "--config {tmp}/wrong.yaml", "{tmp}/wrong.yaml: seq_len must be of type int, got 'long'"),
    (S3, "--dataset_name {tmp}/numbers", "column holds Value('int64'), not text"),
    (S3, "--hidden_size 0", "--hidden_size must be at least 1, got 0"),
    (S3, "--num_attention_heads 3", "num_attention_heads=3 does not divide hidden_size=64"),
    (S3, "--num_key_value_heads 3", "num_key_value_heads=3 does not divide num_attention_heads=4"),
    (S3, "--hidden_size 60", "head_dim=15 (hidden_size / num_attention_heads = 60 / 4) is odd"),
    (S3, "--seq_len 5000", "seq_len=5000 exceeds max_position_embeddings=1024"),
    pytest.param(S3, "--device cuda", "--device cuda: PyTorch sees no GPU here", marks=NO_CUDA),
    (S3, "--device tpu", "--device must be auto, cpu, cuda or cuda:N; got 'tpu'"),
    (S3, "--dtype float64", "--dtype must be one of auto, float32, bfloat16, float16; got 'float"),
    (S3, "--tp_size 2", "tp_size * pp_size * dp_size = 2 * 1 * 1 = 2, but the world size is 1"),
    (S3, "--max_tokens 10", "--max_tokens 10 is less than one step's 64"),
    (S3, "--resume", "--resume needs --save_dir"),
    (S3, "--save_every 5", "--save_every needs --save_dir, the folder to save to"),
    (S3, "--model_name {tmp}/nothing", "--model_name {tmp}/nothing: could not load the model"),
    (
        S3,
        "--model_name {tmp}/no_config",
        "--model_name {tmp}/no_config: could not load the model config: the folder has no valid",
    ),
    (
        S3,
        "--model_name {tmp}/gpt2",
        "--model_name {tmp}/gpt2 is a 'gpt2' model; this step trains llama models",
    ),
    (S3, "--learning_rate inf", "--learning_rate must be finite, got inf"),
    (
        S3,
        "--model_name {tmp}/small_vocab",
        "tokenizer has 2048 tokens but the model's vocab_size is 1000",
    ),
    (S3, "--tokenizer_name {tmp}/nothing", "could not load the tokenizer '{tmp}/nothing'"),
    (S3, "--tokenizer_name {tmp}/badtok", "{tmp}/badtok/tokenizer.json is not valid JSON (Unter"),
    (S3, "--keep_last 2", "--keep_last needs --save_dir"),
    (S3, "--keep_last 0 --save_dir {tmp}/k", "--keep_last must be at least 1, got 0"),
    (S3, "--save_dynamics", "--save_dynamics needs --save_dir: it captures the checkpoints"),
    (S3, "--dist_timeout_s 0", "--dist_timeout_s must be above 0, got 0.0"),
    (S3, "--max_nonfinite_skips 0", "--max_nonfinite_skips must be at least 1, got 0"),
    (S3, "--on_nonfinite ignore", "argument --on_nonfinite: invalid choice: 'ignore'"),
    (S3, "--dataset_name {tmp}/nothing", "could not load the dataset '{tmp}/nothing': it is not"),
    (
        S3,
        "--dataset_name {tmp}/a_folder",
        "from {tmp}/a_folder (EmptyDatasetError: The directory at {tmp}/a_folder doesn't contain",
    ),
    (S3, "--tokenizer_name {tmp}/a_folder", "{tmp}/a_folder holds no tokenizer: none of"),
    (S3, "--save_dir {tmp}/a_file", "--save_dir {tmp}/a_file is an existing file; give a folder"),
    (S3, "--save_dir {tmp}/a_file/run", "{tmp}/a_file is a file, so it cannot hold a folder"),
    (
        S3,
        "--log_file {tmp}/a_folder",
        "--log_file {tmp}/a_folder is an existing folder; give a file",
    ),
    (S3, "--save_dir {tmp}/ckpt_truncated --resume", "model.safetensors is truncated or damaged"),
    (
        S3,
        "--save_dir {tmp}/ckpt_other_pp --resume",
        "has no model.safetensors (it holds model-pp0-of-1-tp0-of-1.safetensors): a later step",
    ),
    (
        S3,
        "--save_dir {tmp}/ckpt_missing --resume",
        "step_000001 is incomplete: it has no trainer_state",
    ),
    (S3, "--save_dir {tmp}/ckpt_nowhere --resume", "{tmp}/ckpt_nowhere/step_000001 does not exist"),
    (
        S3,
        "--save_dir {tmp}/ckpt_other --resume",
        "ckpt_other/step_000001 holds another model: hidden_size 256 (this run: 64)",
    ),
    (
        S3,
        "--save_dir {tmp}/ckpt_badconfig --resume",
        "ckpt_badconfig/step_000001: config.json cannot be read (It looks like the config file",
    ),
    (
        S4,
        "--save_dir {tmp}/ckpt_missing --resume",
        "no shard tp0-of-1 (it holds model.safetensors)",
    ),
    (S6, "--bucket_size_mb 0", "--bucket_size_mb must be above 0, got 0.0"),
    (S6, "--bucket_size_mb -5", "--bucket_size_mb must be above 0, got -5.0"),
    (
        S6,
        "--dp_timeline {tmp}/a_folder",
        "--dp_timeline {tmp}/a_folder is an existing folder; give a file",
    ),
    (
        S8,
        "--save_dir {tmp}/ckpt_other_pp --resume",
        "step_000001 holds another model: hidden_size 256 (this run: 64), intermediate_size 688 "
        "(this run: 128), num_hidden_layers 4 (this run: 2), num_attention_heads 8 (this run: 4)",
    ),
    (S8, "--pp_engine zigzag", "argument --pp_engine: invalid choice: 'zigzag'"),
    (
        S8,
        "--pp_timeline {tmp}/a_file/trace.json",
        "--pp_timeline {tmp}/a_file/trace.json: {tmp}/a_file is a file, so it cannot hold a file",
    ),
    (S9, "--init_from_hf {tmp}/nothing", "--init_from_hf {tmp}/nothing: no such folder"),
    (S9, "--init_from_hf {tmp}/no_config", "--init_from_hf {tmp}/no_config: no config.json"),
    (S9, "--init_from_hf {tmp}/no_weights", "{tmp}/no_weights: no *.safetensors weights"),
    (S9, "--init_from_hf {tmp}/hf_gpt2", "--init_from_hf {tmp}/hf_gpt2 is a 'gpt2' model"),
    (
        S9,
        "--init_from_hf {tmp}/hf_broken",
        "--init_from_hf {tmp}/hf_broken: could not load the model config: the folder has no valid",
    ),
    (S9, "--model_name {tmp}/nothing", "--model_name {tmp}/nothing: could not load the model"),
    (S9, "--dp_size 2", "tp_size * pp_size * dp_size = 1 * 1 * 2 = 2, but the world size is 1"),
]


@pytest.mark.parametrize(("step", "args", "message"), CASES)
def test_bad_input_is_one_line(step, args, message, files, capsys, monkeypatch):
    args = args.replace("{tmp}", str(files)).split()
    message = message.replace("{tmp}", str(files))
    extra = [] if "--dataset_name" in args else ["--dataset_name", str(files / "stories")]
    base = NO_SHAPE if "--init_from_hf" in args else ARGS
    code, output, elapsed = run_in_process(step, [*base, *extra, *args], capsys, monkeypatch)
    assert code == 2, output
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in output, output
    assert "Traceback" not in output, output
    assert elapsed < TIME_LIMIT


def test_a_bug_keeps_its_traceback(monkeypatch):
    """Only our own ValueErrors are user errors: one raised inside a library, or any other
    exception, is a bug, and propagates with its traceback."""
    utils = import_step("step3_dataloader", "utils")
    monkeypatch.setattr(utils.os, "_exit", exit_here)
    param = torch.zeros(1, requires_grad=True)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        utils.run_main(lambda: torch.optim.AdamW([param], lr=-1.0))
    with pytest.raises(ZeroDivisionError):
        utils.run_main(lambda: 1 / 0)


class Writes:
    """A stream that records each write."""

    def __init__(self):
        self.writes = []

    def write(self, text):
        self.writes.append(text)

    def flush(self):
        pass


@pytest.mark.parametrize("step", ["step1_model", "step3_dataloader"])
def test_every_line_is_one_write(step, monkeypatch):
    """A logged line and an error report reach the stream in one write with their newline:
    under PYTHONUNBUFFERED (how torchrun's workers often run) print() writes the two apart, and
    another rank's line lands in between on the shared pipe."""
    utils = import_step(step, "utils")
    out, err = Writes(), Writes()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(utils.os, "_exit", exit_here)
    utils.log("step 1/4 |", "loss", 7.5)

    with pytest.raises(SystemExit):
        utils.run_main(lambda: utils.resolve_device("tpu"))
    assert out.writes == ["step 1/4 | loss 7.5\n"]
    assert err.writes == ["error: --device must be auto, cpu, cuda or cuda:N; got 'tpu'\n"]


def launcher_output(result):
    """Our ranks' output, and torchrun's own report: its traceback (of ChildFailedError) and
    the banner naming the failed ranks, which it prints last."""
    output = result.stdout + result.stderr
    start = output.find("Traceback (most recent call last)")
    assert start >= 0 and "ChildFailedError" in output[start:], output
    return output[:start], output[start:]


def test_plain_python_prints_one_line_and_exits_2():
    start = time.monotonic()
    args = ["--seq_len", "abc"]
    result = run_step("step3_dataloader", args, torchrun=False, timeout=120, fork=False)
    assert time.monotonic() - start < TIME_LIMIT
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines()[-1] == (
        "error: argument --seq_len: invalid int value: 'abc' (--help lists the flags)"
    )
    assert "Traceback" not in result.stderr


# Under torchrun: a flag refused before the process group, a size refused after it (each rank
# then waits for no one), and a damaged shard of the other stage, which every rank checks.
TORCHRUN_CASES = [
    (S9, "--dp_size 2 --bucket_size_mb 0", "--bucket_size_mb must be above 0, got 0.0"),
    (S4, "--tp_size 2 --num_key_value_heads 1", "tp_size=2 does not divide num_key_value_heads=1"),
    (
        S8,
        "--pp_size 2 --save_dir {tmp}/ckpt_pp --resume",
        "pp1-of-2-tp0-of-1.safetensors is truncated",
    ),
]


@pytest.mark.parametrize(("step", "args", "message"), TORCHRUN_CASES)
def test_torchrun_prints_once_and_stops_every_rank(step, args, message, files):
    args = args.replace("{tmp}", str(files)).split()
    args = [*ARGS, "--dataset_name", str(files / "stories"), *args]
    start = time.monotonic()
    result = run_step(step, args, nproc=2, timeout=120, fork=False)  # torchrun's report too
    elapsed = time.monotonic() - start
    ours, report = launcher_output(result)
    errors = [line for line in ours.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], ours
    assert "Traceback" not in ours, ours
    assert "exitcode  : 2" in report  # the rank that reported it; torchrun stops the other
    assert result.returncode != 0
    assert elapsed < TIME_LIMIT
