"""What the data path costs: token shards read in place against rows tokenised in memory.

    python tools/data_bench.py            # about a minute on 2 cores; writes 1 GB to a temp folder

Three measurements, on the machine it runs on:
- the loader's time per micro-batch (step 3's MicroBatchDataLoader, --micro_batch_size 4,
  --seq_len 256) over the default corpus, tokenised in memory and read from shards, the two
  alternated in rounds;
- the resident memory of a process that serves 2,000 micro-batches from a 50 MB and from a 1 GB
  shard set (random tokens, --sizes_mb), each in a fresh process: it must not grow with the
  corpus, but for the epoch's shuffled order, 8 bytes a row;
- tools/prepare_data.py's tokens per second on the default corpus with 1 and 2 processes,
  alternated.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "step3_dataloader"))

import prepare_data  # noqa: E402

import dataloader  # noqa: E402

B, T = 4, 256


def loader_overhead(folder, rounds, batches):
    """Milliseconds per micro-batch, in memory and from shards, best of `rounds` alternated."""
    tokenizer = dataloader.load_tokenizer("tinytales")
    train, _ = dataloader.load_splits("tinytales", seed=42)
    in_memory = dataloader.tokenize(train, tokenizer, T, num_proc=1)
    index = json.loads((folder / dataloader.SHARD_INDEX).read_text())
    shards = dataloader.TokenShards(folder, index, "train", T)
    times = {"in memory": [], "shards": []}
    for _ in range(rounds):
        for name, rows in [("in memory", in_memory), ("shards", shards)]:
            loader = dataloader.MicroBatchDataLoader(rows, B, 0, "cpu")
            start = time.perf_counter()
            for _ in range(batches):
                next(loader)
            times[name].append((time.perf_counter() - start) / batches * 1e3)
    return {name: min(t) for name, t in times.items()}, len(in_memory), len(shards)


def synthetic_shards(folder, tokens):
    """A shard set of random token ids that the tinytales tokenizer accepts: 100M-token shards."""
    tokenizer = dataloader.load_tokenizer("tinytales")
    folder.mkdir()
    generator, shards, left = np.random.default_rng(0), [], tokens
    while left:
        count = min(left, 100_000_000)
        name = f"train_{len(shards):06d}.bin"
        generator.integers(0, len(tokenizer), count, dtype=np.uint16).tofile(folder / name)
        shards.append({"file": name, "tokens": count})
        left -= count
    (folder / "validation_000000.bin").write_bytes(np.zeros(T + 1, np.uint16).tobytes())
    index = {
        "tokenizer": "tinytales",
        "vocab_size": len(tokenizer),
        "fingerprint": dataloader.fingerprint(tokenizer),
        "dtype": "uint16",
        "splits": {
            "train": shards,
            "validation": [{"file": "validation_000000.bin", "tokens": T + 1}],
        },
    }
    (folder / dataloader.SHARD_INDEX).write_text(json.dumps(index))


SERVE = """
import json, sys
sys.path.insert(0, {step!r})
import dataloader
def rss():
    line = next(l for l in open("/proc/self/status") if l.startswith("VmRSS"))
    return int(line.split()[1]) / 1024
before = rss()
tokenizer = dataloader.load_tokenizer("tinytales")
index = dataloader.read_shard_index({folder!r}, tokenizer, "tinytales")
rows = dataloader.TokenShards({folder!r}, index, "train", {T})
loader = dataloader.MicroBatchDataLoader(rows, {B}, 0, "cpu")
for _ in range({batches}):
    next(loader)
print(json.dumps({{"rows": len(rows), "before": before, "after": rss()}}))
"""


def resident_memory(folder, batches):
    """A fresh process's resident MiB before the loader and after `batches` micro-batches."""
    code = SERVE.format(step=str(ROOT / "step3_dataloader"), folder=str(folder), T=T, B=B,
                        batches=batches)  # fmt: skip
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def prepare_rate(tmp, rounds):
    """tools/prepare_data.py's tokens/s on the default corpus (the train split), best of rounds."""
    rates = {1: [], 2: []}
    for r in range(rounds):
        for n in rates:
            out = str(tmp / f"prepare{n}_{r}")
            args = prepare_data.parse_args(["--out_dir", out, "--num_proc", str(n)])
            rates[n].append(prepare_data.prepare(args)["train"])
    return {n: max(r) for n, r in rates.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=2000, help="micro-batches per round")
    parser.add_argument("--sizes_mb", default="50,1000", help="the shard sets' sizes, MB")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        prepare_data.prepare(prepare_data.parse_args(["--out_dir", str(tmp / "tinytales")]))
        times, memory_rows, shard_rows = loader_overhead(
            tmp / "tinytales", args.rounds, args.batches
        )
        print(f"\nloader, ms per micro-batch of {B} x {T + 1} tokens (best of {args.rounds}):")
        print(f"  in memory ({memory_rows:,} rows): {times['in memory']:.3f}")
        print(f"  shards    ({shard_rows:,} rows): {times['shards']:.3f}")
        print(f"\nresident MiB of a process serving {args.batches:,} micro-batches:")
        for mb in map(int, args.sizes_mb.split(",")):
            synthetic_shards(tmp / f"{mb}MB", mb * 500_000)  # 2 bytes a token
            seen = resident_memory(tmp / f"{mb}MB", args.batches)
            grew = seen["after"] - seen["before"]
            print(f"  {mb:,} MB shard set ({seen['rows']:,} rows): {seen['before']:.0f} after "
                  f"imports, {seen['after']:.0f} after serving (+{grew:.0f})")  # fmt: skip
        rates = prepare_rate(tmp, 2)
        print("\nprepare_data.py, train split of the default corpus, tokens/s (best of 2):")
        for n, rate in rates.items():
            print(f"  --num_proc {n}: {rate:,.0f}")


if __name__ == "__main__":
    main()
