"""What the data path costs: token shards read in place against rows tokenised in memory.

    python tools/data_bench.py            # about a minute on 2 cores; writes 2 GB to a temp folder

Four measurements, on the machine it runs on:
- the loader's time per micro-batch (step 3's MicroBatchDataLoader, --micro_batch_size 4,
  --seq_len 256) over the default corpus, tokenised in memory and read from shards, the two
  alternated in rounds;
- the resident memory of a process that serves 2,000 micro-batches from a 50 MB and from a 1 GB
  shard set (random tokens, --sizes_mb), each in a fresh process: it must not grow with the
  corpus, but for the epoch's shuffled order, 8 bytes a row;
- what checking each shard's CRC-32 costs on the largest set cut into 50 shards: the whole set
  checked in one thread, and the loader's wait over its first 60 micro-batches with 30 ms of
  compute after each, its checks as the trainer runs them (a thread ahead of the reader), by the
  reader alone, and none, alternated;
- tools/prepare_data.py's tokens per second on the default corpus with 1 and 2 processes,
  alternated.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
import zlib
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


def synthetic_shards(folder, tokens, shard_tokens=100_000_000):
    """A shard set of random token ids that the tinytales tokenizer accepts, with its CRC-32s."""
    tokenizer = dataloader.load_tokenizer("tinytales")
    folder.mkdir()
    generator, shards, left = np.random.default_rng(0), [], tokens
    while left:
        count = min(left, shard_tokens)
        name = f"train_{len(shards):06d}.bin"
        ids = generator.integers(0, len(tokenizer), count, dtype=np.uint16)
        ids.tofile(folder / name)
        shards.append({"file": name, "tokens": count, "crc32": zlib.crc32(ids)})
        left -= count
    validation = np.zeros(T + 1, np.uint16)
    validation.tofile(folder / "validation_000000.bin")
    index = {
        "tokenizer": "tinytales",
        "vocab_size": len(tokenizer),
        "fingerprint": dataloader.fingerprint(tokenizer),
        "dtype": "uint16",
        "max_token_id": len(tokenizer) - 1,
        "splits": {
            "train": shards,
            "validation": [
                {"file": "validation_000000.bin", "tokens": T + 1, "crc32": zlib.crc32(validation)}
            ],
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


def check_cost(folder, rounds, batches, compute=0.03):
    """Milliseconds: every train shard's CRC-32 taken in one thread; and the loader's wait for its
    first micro-batch and for all `batches` of them, `compute` seconds of sleep (which releases
    the GIL, as a step on a GPU does) after each, with the checks as the trainer runs them, by
    the reader alone (no thread), and with none. Best of `rounds`, alternated."""
    index = json.loads((folder / dataloader.SHARD_INDEX).read_text())
    check, ahead = dataloader.Shard.check, dataloader.TokenShards.check_ahead
    unchecked = lambda self: setattr(self, "checked", self.stamp())  # noqa: E731 (no CRC-32)
    variants = {"no CRC-32": (unchecked, ahead), "reader alone": (check, lambda self: None)}
    variants["thread ahead"] = (check, ahead)  # as the trainer runs them
    whole, waits = [], {name: [] for name in variants}
    for _ in range(rounds):
        rows = dataloader.TokenShards(folder, index, "train", T)
        start = time.perf_counter()
        for shard in rows.shards:
            shard.check()
        whole.append((time.perf_counter() - start) * 1e3)
        for name, (check_one, check_all) in variants.items():
            dataloader.Shard.check, dataloader.TokenShards.check_ahead = check_one, check_all
            loader = dataloader.MicroBatchDataLoader(
                dataloader.TokenShards(folder, index, "train", T), B, 0, "cpu"
            )
            wait = []
            for _ in range(batches):
                start = time.perf_counter()
                next(loader)
                wait.append((time.perf_counter() - start) * 1e3)
                time.sleep(compute)
            waits[name].append((wait[0], sum(wait)))
    dataloader.Shard.check, dataloader.TokenShards.check_ahead = check, ahead
    best = {name: (min(f for f, _ in w), min(t for _, t in w)) for name, w in waits.items()}
    return min(whole), best


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
        mb, batches = max(map(int, args.sizes_mb.split(","))), min(args.batches, 60)
        synthetic_shards(tmp / "check", mb * 500_000, shard_tokens=mb * 10_000)  # 50 shards
        whole, waits = check_cost(tmp / "check", args.rounds, batches)
        print(f"\nCRC-32 checks of a {mb:,} MB shard set in 50 shards (best of {args.rounds}):")
        print(f"  every shard in one thread: {whole:.1f} ms ({mb / whole:.2f} GB/s)")
        print(
            f"  the loader's wait, ms, with 30 ms of compute after each of {batches} micro-batches:"
        )
        for name, (first, total) in waits.items():
            print(f"    {name:12}: {first:7.1f} for the first, {total:7.1f} for all")
        rates = prepare_rate(tmp, 2)
        print("\nprepare_data.py, train split of the default corpus, tokens/s (best of 2):")
        for n, rate in rates.items():
            print(f"  --num_proc {n}: {rate:,.0f}")


if __name__ == "__main__":
    main()
