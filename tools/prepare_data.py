"""Tokenise a corpus once, into a folder of token shards that every rank reads its rows from.

    python tools/prepare_data.py --out_dir data/tinytales      # the embedded corpus, offline
    python step3_dataloader/train.py --dataset_name data/tinytales

Each split's documents are tokenised in order by --num_proc processes, each document followed by
the end-of-text token, and written as one flat array of token ids (uint16 when the tokenizer's
ids fit, else uint32), cut into shards of about --shard_tokens tokens that end where a batch of
documents ends: train_000000.bin, train_000001.bin, ..., validation_000000.bin. shards.json,
written last, names the tokenizer, its vocabulary size and fingerprint, the dtype, the largest
token id written, and each shard's tokens, CRC-32 and largest id; the trainer refuses shards of
another tokenizer, cut short, damaged (a shard's CRC-32 is checked before its rows are read), or
with ids the model's vocabulary does not hold. The bytes do not depend on --num_proc.

A local dataset is split as the trainer splits it (its validation split, or 1 % of train held out
with --seed); a hub dataset is streamed (it never has to fit in memory or on disk; that needs the
network), and without a validation split every 100th document is held out. A run stopped midway
goes on from its last whole shard when started again with the same flags (a stream reads the
documents before that point again, and skips them); a finished folder is checked and left as it is,
but for the largest token id, added to a shards.json written before it was recorded.
"""

# N tokens

import argparse
import itertools
import json
import multiprocessing
import os
import sys
import time
import zlib
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "step3_dataloader"))  # the trainer's own tokenizer and splits

from dataloader import (  # noqa: E402
    PROGRESS,
    SHARD_INDEX,
    fingerprint,
    largest_id,
    load_splits,
    load_tokenizer,
    open_stream,
    resolve,
    shard_dtype,
)

BATCH = 256  # documents per task of a tokenising process; a shard ends at a batch's end


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--dataset_name", default="tinytales", help="assets/datasets/NAME, a path or hub id"
    )
    parser.add_argument(
        "--tokenizer_name", default="tinytales", help="assets/tokenizers/NAME, a path or hub"
    )
    parser.add_argument("--out_dir", required=True, help="the folder of shards to write")
    parser.add_argument("--num_proc", type=int, default=2, help="tokenising processes")
    parser.add_argument(
        "--shard_tokens", type=int, default=100_000_000, help="tokens per shard, about"
    )
    parser.add_argument("--seed", type=int, default=42, help="the held-out 1 %%, as the trainer's")
    parser.add_argument("--streaming", action="store_true", help="stream a local dataset too")
    args = parser.parse_args(argv)
    if args.num_proc < 1 or args.shard_tokens < 1:
        parser.error(
            f"--num_proc and --shard_tokens must be at least 1; got {args.num_proc} and "
            f"{args.shard_tokens}"
        )
    return args


### begin Documents
def splits(args):
    """The train and validation documents' texts, as two iterables of batches of texts."""
    if Path(resolve(args.dataset_name, "datasets")).exists() and not args.streaming:
        train, validation = load_splits(args.dataset_name, args.seed)  # refuses what cannot load
        return {"train": in_batches(train), "validation": in_batches(validation)}
    # A stream, read as it is tokenised, split as the trainer's --streaming splits it.
    return {s: batched(open_stream(args.dataset_name, s)) for s in ("train", "validation")}


def in_batches(dataset):
    for start in range(0, len(dataset), BATCH):
        yield dataset[start : start + BATCH]["text"]


def batched(documents):
    while batch := list(itertools.islice(documents, BATCH)):
        yield batch


### end Documents


### begin Tokenising
TOKENIZER = None  # each tokenising process loads its own


def load_worker_tokenizer(name):
    global TOKENIZER
    TOKENIZER = load_tokenizer(name)


def encode(batch):
    """A batch of documents as one array of token ids, each document followed by end-of-text;
    and how many documents it holds."""
    ids = TOKENIZER(batch, add_special_tokens=False)["input_ids"]
    eos = TOKENIZER.eos_token_id
    return np.fromiter((t for doc in ids for t in (*doc, eos)), dtype=np.int64), len(batch)


def checked(batches, split, first):
    """The batches, each text checked to be a string, with the number of its first document."""
    for number, batch in enumerate(batches):
        for i, text in enumerate(batch):
            if not isinstance(text, str):
                document = first + number * BATCH + i
                raise ValueError(
                    f"the {split} split's document {document} is a {type(text).__name__}, not "
                    f"text: {text!r:.60}"
                )
        yield batch


### end Tokenising


class Progress:
    """One line of tokens, documents and tokens/s: rewritten in place on a terminal, else printed
    every 10 seconds."""

    def __init__(self, split, tokens, documents):
        self.split, self.tokens, self.documents = split, tokens, documents
        self.start_tokens, self.start = tokens, time.perf_counter()
        self.shown, self.tty = self.start, sys.stderr.isatty()

    def add(self, tokens, documents, force=False):
        self.tokens, self.documents = self.tokens + tokens, self.documents + documents
        now = time.perf_counter()
        if force or self.tty or now - self.shown > 10:
            rate = (self.tokens - self.start_tokens) / max(now - self.start, 1e-9)
            line = f"{self.split}: {self.tokens:,} tokens, {self.documents:,} documents, "
            line += f"{rate:,.0f} tokens/s"
            print(f"\r{line}" if self.tty else line, end="" if self.tty else "\n", file=sys.stderr)
            self.shown = now

    def rate(self):
        return (self.tokens - self.start_tokens) / max(time.perf_counter() - self.start, 1e-9)


def write_atomic(path, data):
    """The file whole or not at all: written under a temporary name, then renamed."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_split(args, settings, state, split, batches, pool):
    """Tokenise one split into shards, from where `state` says it stopped."""
    done = state["splits"].setdefault(split, {"documents": 0, "shards": [], "finished": False})
    if done["finished"]:
        return None
    assert done["documents"] % BATCH == 0, done  # every shard but a split's last ends a batch
    out, first = Path(args.out_dir), done["documents"]
    batches = checked(itertools.islice(batches, first // BATCH, None), split, first)
    encoded = pool.imap(encode, batches) if pool else map(encode, batches)
    progress = Progress(split, sum(s["tokens"] for s in done["shards"]), first)
    buffer, documents = [], 0
    for tokens, count in encoded:
        buffer.append(tokens)
        documents += count
        progress.add(len(tokens), count)
        if sum(len(b) for b in buffer) >= args.shard_tokens:
            write_shard(out, state, split, np.concatenate(buffer), documents)
            buffer, documents = [], 0
    if buffer:
        write_shard(out, state, split, np.concatenate(buffer), documents)
    done["finished"] = True
    write_atomic(out / PROGRESS, json.dumps(state).encode())
    progress.add(0, 0, force=True)
    if progress.tty:
        print(file=sys.stderr)
    return progress.rate()


def write_shard(out, state, split, tokens, documents):
    """The next shard of `split`, then the progress file that counts it."""
    done = state["splits"][split]
    data = tokens.astype(state["settings"]["dtype"]).tobytes()
    name = f"{split}_{len(done['shards']):06d}.bin"
    write_atomic(out / name, data)
    largest = int(tokens.max())  # within the dtype, chosen from the tokenizer's largest id
    assert largest <= np.iinfo(state["settings"]["dtype"]).max, largest
    record = {"file": name, "tokens": len(tokens), "crc32": zlib.crc32(data)}
    done["shards"].append({**record, "max_token_id": largest})
    done["documents"] += documents
    write_atomic(out / PROGRESS, json.dumps(state).encode())


def check_shards(out, index):
    """Every shard of a finished folder there, whole, and with its checksum; the largest token id
    of each is recorded if it was not."""
    for shard in (s for split in index["splits"].values() for s in split):
        path = out / shard["file"]
        data = path.read_bytes() if path.is_file() else None
        if data is None or zlib.crc32(data) != shard["crc32"]:
            raise ValueError(
                f"{path} is missing or not what {SHARD_INDEX} says (its CRC-32 differs): "
                f"remove the folder and prepare it again"
            )
        shard.setdefault("max_token_id", int(np.frombuffer(data, index["dtype"]).max()))
    largest = max(s["max_token_id"] for split in index["splits"].values() for s in split)
    if index.get("max_token_id") != largest:  # a folder written before it was recorded
        index["max_token_id"] = largest
        write_atomic(out / SHARD_INDEX, json.dumps(index, indent=1).encode())
        print(f"{out / SHARD_INDEX}: recorded its largest token id, {largest}")


def start_state(args, settings):
    """Where to begin: a new folder, or the progress of a run stopped with the same flags; None
    when the folder is already finished with them."""
    out = Path(args.out_dir)
    for name in (SHARD_INDEX, PROGRESS):
        if (out / name).is_file():
            state = json.loads((out / name).read_text())
            if state["settings"] != settings:
                differ = [k for k in settings if state["settings"].get(k) != settings[k]]
                raise ValueError(
                    f"--out_dir {out} holds shards made with other settings ({', '.join(differ)} "
                    f"differ); give another folder, or remove it"
                )
            if name == SHARD_INDEX:
                check_shards(out, state)
                return None
            return state
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out_dir {out} is not empty and holds no shards; give a new folder")
    out.mkdir(parents=True, exist_ok=True)
    return {"settings": settings, "splits": {}}


def prepare(args):
    """Write the shards; each split's tokens/s (None for a split done before), {} when finished."""
    tokenizer = load_tokenizer(args.tokenizer_name)
    settings = {
        "dataset": args.dataset_name,
        "tokenizer": args.tokenizer_name,
        "vocab_size": len(tokenizer),
        "fingerprint": fingerprint(tokenizer),
        "dtype": shard_dtype(largest_id(tokenizer) + 1),
        "shard_tokens": args.shard_tokens,
        "seed": args.seed,
        "streaming": args.streaming,
    }
    out = Path(args.out_dir)
    state = start_state(args, settings)
    if state is None:
        print(f"{out} is finished and whole: nothing to do")
        return {}
    documents = splits(args)
    pool = None
    if args.num_proc > 1:
        # Spawned, not forked: a fork of a process whose tokenizer has run its thread pool can
        # inherit a lock held by a thread that is not there, and hang.
        pool = multiprocessing.get_context("spawn").Pool(
            args.num_proc, initializer=load_worker_tokenizer, initargs=(args.tokenizer_name,)
        )
        pool.map(time.sleep, [0.1] * args.num_proc, chunksize=1)  # started: not in tokens/s
    else:
        load_worker_tokenizer(args.tokenizer_name)
    try:
        rates = {s: write_split(args, settings, state, s, documents[s], pool) for s in documents}
    finally:
        if pool:
            pool.terminate()
    index = {**settings, "splits": {s: d["shards"] for s, d in state["splits"].items()}}
    for split, shards in index["splits"].items():
        if not sum(s["tokens"] for s in shards):
            raise ValueError(f"the dataset's {split} split has no documents")
        for shard in (s for s in shards if "max_token_id" not in s):  # in an older progress.json
            shard["max_token_id"] = int(np.fromfile(out / shard["file"], settings["dtype"]).max())
    index["max_token_id"] = max(s["max_token_id"] for v in index["splits"].values() for s in v)
    write_atomic(out / SHARD_INDEX, json.dumps({"settings": settings, **index}, indent=1).encode())
    (out / PROGRESS).unlink()
    for split, shards in index["splits"].items():
        tokens = sum(s["tokens"] for s in shards)
        rate = f", {rates[split]:,.0f} tokens/s" if rates[split] else ""
        print(
            f"{out}: {split} {tokens:,} tokens in {len(shards)} shards of {settings['dtype']}, "
            f"{state['splits'][split]['documents']:,} documents{rate}"
        )
    return rates


def main(argv=None):
    args = parse_args(argv)
    try:
        prepare(args)
    except ValueError as error:
        print(f"prepare_data.py: error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
