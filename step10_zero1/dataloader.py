"""Real data: a text dataset tokenised, cut into fixed-length rows and served in micro-batches.

Every document's tokens are followed by the end-of-text token and concatenated, then cut into rows
of T + 1 tokens: the inputs are the first T, the targets the last T (the same row shifted by one),
so every position predicts the next token. The rows are served in a shuffled order that depends on
the seed and the epoch only, so a run is reproducible and can resume from a position.

Under data parallelism the ranks read the same stream of micro-batches and each takes its own:
the k-th micro-batch of dp rank r is micro-batch k * dp_size + r of the stream. Together the ranks
see exactly what one process sees with dp_size times the accumulation, each row once.

A corpus too large to tokenise at every start is tokenised once by tools/prepare_data.py into a
folder of token shards; --dataset_name FOLDER reads from them only the rows it serves
(`TokenShards`), so a rank's memory does not grow with the corpus.
"""

# B micro-batch size, T tokens per row

import hashlib
import json
import os
import threading
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from datasets import Dataset, DatasetDict, load_dataset
from transformers import AutoTokenizer

from flags import ASSETS
from utils import log


def resolve(name, kind):
    """A local path, a name in assets/KIND (the offline defaults), or else a hub id."""
    if Path(name).exists():
        return str(name)
    if (ASSETS / kind / name).exists():
        return str(ASSETS / kind / name)
    return name


def offline_hint(what, name, default, error):
    return ValueError(
        f"could not load the {what} {name!r}: it is not a local path, and the Hugging Face hub "
        f"could not be reached or has no such {what}. The offline default is {default!r} "
        f"(in assets/).\n{type(error).__name__}: {error}"
    )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # a folder holds one or both


def load_tokenizer(name):
    path = resolve(name, "tokenizers")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as error:
        if Path(path).is_dir():  # the folder is there: one of its files is what is wrong
            message = f"could not load the tokenizer {name!r}: {broken_file(path, error)}"
            raise ValueError(message) from error
        raise offline_hint("tokenizer", name, "tinytales", error) from error
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer {name!r} has no end-of-text token to separate documents")
    return tokenizer


def broken_file(folder, error):
    """What is wrong in a tokenizer folder: no tokenizer files, or which of its JSON files cannot
    be parsed, and the parser's words."""
    if not any((Path(folder) / file).exists() for file in TOKENIZER_FILES):
        return f"{folder} holds no tokenizer: none of {', '.join(TOKENIZER_FILES)}"
    for file in sorted(Path(folder).glob("*.json")):
        try:
            json.loads(file.read_text())
        except (ValueError, UnicodeDecodeError) as parse_error:
            return f"{file} is not valid JSON ({parse_error})"
    return f"its files in {folder} cannot be read as a tokenizer ({type(error).__name__}: {error})"


def load_splits(name, seed, text_column="text"):
    """The train and validation splits; 1 % of train is held out when there is no validation."""
    path = resolve(name, "datasets")
    try:
        splits = load_dataset(path)
    except Exception as error:  # datasets raises many kinds of error for an unreachable hub
        if Path(path).exists():  # the path is there: what it holds is what is wrong
            cause = error.__cause__  # datasets' own words are often vague; the cause's are not
            why = f"{type(error).__name__}: {error}"
            why += f"; {type(cause).__name__}: {cause}" if cause else ""
            raise ValueError(f"could not load the dataset {name!r} from {path} ({why})") from error
        raise offline_hint("dataset", name, "tinytales", error) from error
    if "validation" not in splits:
        held_out = splits["train"].train_test_split(test_size=0.01, seed=seed)
        splits = DatasetDict(train=held_out["train"], validation=held_out["test"])
    for split in ("train", "validation"):
        if text_column not in splits[split].column_names:
            raise ValueError(f"dataset {name!r} has no {text_column!r} column in its {split} split")
        feature = splits[split].features[text_column]
        if getattr(feature, "dtype", None) not in ("string", "large_string"):
            raise ValueError(
                f"dataset {name!r}: the {split} split's {text_column!r} column holds {feature}, "
                f"not text"
            )
    return splits["train"], splits["validation"]


def tokenize(dataset, tokenizer, seq_len, num_proc, text_column="text"):
    """Rows of T + 1 token ids: documents joined by end-of-text, cut into equal lengths. The
    documents are tokenised by `num_proc` processes, then cut in one pass over the whole stream,
    so the rows do not depend on num_proc: only the last partial row is dropped."""
    eos, row = tokenizer.eos_token_id, seq_len + 1

    def to_ids(batch):
        ids = tokenizer(batch[text_column], add_special_tokens=False)["input_ids"]
        return {"ids": [[*doc, eos] for doc in ids]}

    documents = dataset.map(
        to_ids,
        batched=True,
        batch_size=1000,
        num_proc=num_proc if num_proc > 1 else None,
        remove_columns=dataset.column_names,
        desc="tokenising",
    )
    # The stream, as Arrow's flat arrays of the documents' ids: no Python list of every token.
    stream = np.concatenate(
        [chunk.flatten().to_numpy() for chunk in documents.data.column("ids").chunks]
        or [np.zeros(0, np.int64)]
    )
    count = len(stream) // row
    if count == 0:
        raise ValueError(f"the dataset is too small for one row of seq_len + 1 = {row} tokens")
    if (stream == eos).all():
        raise ValueError("the dataset's documents are all empty: its rows hold end-of-text only")
    rows = pa.FixedSizeListArray.from_arrays(pa.array(stream[: count * row]), row)
    return Dataset(pa.table({"tokens": rows})).with_format("torch")


### begin Token shards
SHARD_INDEX = "shards.json"  # what tools/prepare_data.py writes last, once every shard is whole
PROGRESS = "progress.json"  # what it writes while it works, and removes once it has finished
CHECK_BYTES = 1 << 20  # a shard's CRC-32 is taken over reads of 1 MiB: no copy of the whole file


def shard_dtype(vocab_size):
    """The smallest unsigned integer type that holds every token id."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def fingerprint(tokenizer):
    """A short hash of the vocabulary (token -> id) and the end-of-text id: shards made with
    another tokenizer have another one, whatever the tokenizer was called."""
    vocab = sorted(tokenizer.get_vocab().items())
    text = json.dumps([vocab, tokenizer.eos_token_id])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def largest_id(tokenizer):
    """The largest id the tokenizer gives; not always len - 1, as an added token may sit past a
    gap in the ids."""
    return max(tokenizer.get_vocab().values())


def check_vocabulary(what, largest, vocab_size):
    """Refuse token ids the model has no embedding row for: caught here, before the first step,
    not mid-run by the embedding (or, split over ranks, turned into zero vectors and trained on)."""
    if largest >= vocab_size:
        ids = f"ids {vocab_size} to {largest}" if largest > vocab_size else f"id {largest}"
        raise ValueError(
            f"{what} but the model's vocab_size is {vocab_size}: it has no embedding for {ids}; "
            f"give a --model_name whose vocab_size is at least {largest + 1}"
        )


def check_tokenizer_ids(tokenizer, vocab_size):
    """The tokenizer's ids against the model's vocabulary: those of text tokenised in memory or
    streamed, and of the sample's prompt."""
    largest, what = largest_id(tokenizer), f"the tokenizer has {len(tokenizer)} tokens"
    if largest != len(tokenizer) - 1:  # a gap in its ids
        what += f", with ids up to {largest},"
    check_vocabulary(what, largest, vocab_size)


def is_shard_folder(name):
    """Whether --dataset_name is a folder of token shards, whole. One that tools/prepare_data.py
    has not finished, or one of its files, is refused, not handed to datasets as a dataset."""
    path = Path(name)
    if (path / SHARD_INDEX).is_file():
        return True
    if path.is_file() and (path.name == SHARD_INDEX or path.suffix == ".bin"):
        raise ValueError(
            f"--dataset_name {name} is a file of a folder of token shards; give the folder: "
            f"--dataset_name {path.parent}"
        )
    if path.is_dir() and (path / PROGRESS).is_file():
        raise ValueError(
            f"--dataset_name {name} has no {SHARD_INDEX}: tools/prepare_data.py was stopped "
            f"before it finished (its {PROGRESS} is there); run it again with --out_dir {name} "
            f"and the same flags to finish"
        )
    if path.is_dir() and any(path.glob("*.bin")):
        raise ValueError(
            f"--dataset_name {name} holds token shards (*.bin) but no {SHARD_INDEX}, the index "
            f"that tools/prepare_data.py writes once every shard is whole; prepare the corpus "
            f"again with tools/prepare_data.py --out_dir NEW_FOLDER"
        )
    return False


class Shard:
    """One file of token ids, read only once its bytes are those whose CRC-32 shards.json gives:
    checked before its first read, and again whenever the file has changed since (its size or
    time stamps), so that a shard damaged during the run stops it before its rows are trained."""

    def __init__(self, path, first, tokens, crc32):
        self.path, self.first, self.tokens, self.crc32 = path, first, tokens, crc32
        self.fd = os.open(path, os.O_RDONLY)
        self.lock = threading.Lock()  # the reader and the checker never check it both at once
        self.checked = None  # the file's stamp when its bytes were last found whole

    def __del__(self):
        if hasattr(self, "fd"):
            os.close(self.fd)

    def stamp(self):
        status = os.fstat(self.fd)
        return status.st_size, status.st_mtime_ns, status.st_ctime_ns

    def check(self):
        """The CRC-32 against shards.json's, unless the file is unchanged since it was whole."""
        with self.lock:
            stamp = self.stamp()
            if stamp == self.checked:
                return
            crc, offset = 0, 0
            while chunk := os.pread(self.fd, CHECK_BYTES, offset):
                crc, offset = zlib.crc32(chunk, crc), offset + len(chunk)
            if crc != self.crc32:
                raise ValueError(
                    f"{self.path} is damaged: its CRC-32 is {crc:08x}, not the {self.crc32:08x} "
                    f"of {SHARD_INDEX} (it changed after tools/prepare_data.py wrote it); the "
                    f"run stops before training on it: put back a whole copy, or prepare the "
                    f"folder again, and --resume goes on exactly"
                )
            self.checked = stamp

    def read(self, begin, end, itemsize):
        """Its tokens `begin` to `end`, as bytes, from the file as it was checked."""
        while True:
            self.check()
            data = os.pread(self.fd, (end - begin) * itemsize, begin * itemsize)
            if self.stamp() == self.checked:  # not changed while it was read
                return data


class TokenShards:
    """One split of a folder of token shards as rows of T + 1 tokens: the split's shards, read in
    order, are one stream of tokens (documents joined by end-of-text), cut into rows from its
    start; the tokens after the last whole row are not used. `rows[indices]["tokens"]` is (B, T+1),
    as a tokenised dataset gives, and reads only those rows from the files, with positioned reads
    rather than a memory map: a map's pages count in the process's resident memory once touched,
    and after enough random rows that is the whole corpus.

    Each shard's CRC-32 is checked before its rows are served (`Shard`). The first read checks
    the shards it reads; then a thread checks the others, in order, ahead of the reader (the
    reads and zlib release the GIL), so that the next micro-batches, whose shuffled rows soon
    touch every shard, seldom wait for one (tools/data_bench.py measures both). The reader
    checks itself a shard it reaches before the thread does."""

    def __init__(self, folder, index, split, seq_len):
        self.row, self.dtype = seq_len + 1, np.dtype(index["dtype"])
        self.shards, first = [], 0
        for shard in index["splits"][split]:
            path = Path(folder) / shard["file"]
            self.shards.append(Shard(path, first, shard["tokens"], shard["crc32"]))
            first += shard["tokens"]
        self.length = first // self.row
        self.checker, self.failed = None, None  # the thread, and a shard it found damaged

    def check_ahead(self):
        for shard in self.shards:
            try:
                shard.check()
            except (ValueError, OSError):
                self.failed = shard  # the reader stops at its next read, whichever rows it wants
                return

    def __len__(self):
        return self.length

    def tokens(self, start, count):
        """`count` tokens of the stream from `start`, across shard ends."""
        parts, size = [], self.dtype.itemsize
        for shard in self.shards:
            if start < shard.first + shard.tokens and start + count > shard.first:
                begin = max(start - shard.first, 0)
                end = min(start + count - shard.first, shard.tokens)
                parts.append(np.frombuffer(shard.read(begin, end, size), self.dtype))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, indices):
        if self.failed:
            self.failed.check()  # raises, unless the shard was made whole again since
            self.failed = None
        rows = [self.tokens(i * self.row, self.row) for i in indices]
        if self.checker is None:  # after the first rows: it does not compete with their checks
            self.checker = threading.Thread(target=self.check_ahead, daemon=True)
            self.checker.start()
        return {"tokens": torch.from_numpy(np.stack(rows))}  # (B, T+1)


def read_shard_index(folder, tokenizer, tokenizer_name):
    """The index of a folder of token shards, checked against this run: made with this tokenizer,
    every shard there and of the length the index gives (none cut short by a crash or a copy)."""
    try:
        index = json.loads((Path(folder) / SHARD_INDEX).read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"--dataset_name {folder}: cannot read {SHARD_INDEX}: {error}") from error
    if not isinstance(index, dict):
        raise ValueError(f"--dataset_name {folder}: its {SHARD_INDEX} is not an index of shards")
    missing = [
        k for k in ("tokenizer", "vocab_size", "fingerprint", "dtype", "splits") if k not in index
    ]
    if missing or index["dtype"] not in ("uint16", "uint32"):
        why = f"has no {missing[0]!r}" if missing else f"names dtype {index['dtype']!r}"
        raise ValueError(f"--dataset_name {folder}: its {SHARD_INDEX} {why}; prepare it again")
    if not isinstance(index.get("max_token_id", 0), int):
        raise ValueError(
            f"--dataset_name {folder}: its {SHARD_INDEX}'s max_token_id is not a number"
        )
    splits = index["splits"]
    for split in ("train", "validation"):
        shards = splits.get(split) if isinstance(splits, dict) else None
        if not isinstance(shards, list) or not all(
            isinstance(s, dict) and {"file", "tokens", "crc32"} <= s.keys() for s in shards
        ):
            raise ValueError(
                f"--dataset_name {folder}: its {SHARD_INDEX} does not list the {split} split's "
                f"shards with their tokens and CRC-32; prepare it again"
            )
    if index["fingerprint"] != fingerprint(tokenizer):
        raise ValueError(
            f"--dataset_name {folder} was tokenised with {index['tokenizer']!r} "
            f"({index['vocab_size']} tokens), not with --tokenizer_name {tokenizer_name!r} "
            f"({len(tokenizer)} tokens); give the tokenizer it was made with, or prepare it again"
        )
    if np.iinfo(index["dtype"]).max < largest_id(tokenizer):
        raise ValueError(
            f"--dataset_name {folder}: its dtype {index['dtype']} cannot hold token ids up to "
            f"{largest_id(tokenizer)}"
        )
    itemsize = np.dtype(index["dtype"]).itemsize
    names = {shard["file"] for split in index["splits"].values() for shard in split}
    extra = sorted(p.name for p in Path(folder).glob("*.bin") if p.name not in names)
    if extra:
        raise ValueError(f"--dataset_name {folder}: {extra[0]} is not in its {SHARD_INDEX}")
    for shard in (shard for split in index["splits"].values() for shard in split):
        path = Path(folder) / shard["file"]
        size = path.stat().st_size if path.is_file() else None
        if size != shard["tokens"] * itemsize:
            what = "is missing" if size is None else f"holds {size:,} bytes"
            raise ValueError(
                f"--dataset_name {folder}: {shard['file']} {what}, but {SHARD_INDEX} says "
                f"{shard['tokens']:,} tokens of {itemsize} bytes; prepare the folder again"
            )
    return index


def load_shards(args, index):
    """The training and validation rows of --dataset_name, a folder of token shards."""
    splits = []
    for name in ("train", "validation"):
        splits.append(TokenShards(args.dataset_name, index, name, args.seq_len))
        if len(splits[-1]) == 0:
            raise ValueError(
                f"--dataset_name {args.dataset_name}: its {name} split is too small for one row "
                f"of seq_len + 1 = {args.seq_len + 1} tokens"
            )
    return splits


### end Token shards


### begin Streaming
HELD_OUT = 100  # a stream without a validation split: every 100th document is held out


def open_stream(name, split):
    """The texts of one split of `name` (a hub id, or a local dataset), read as they come:
    nothing is downloaded or tokenised ahead. Without a validation split, validation is every
    HELD_OUT-th document of train and train the others."""
    from datasets import load_dataset

    try:
        stream = load_dataset(resolve(name, "datasets"), streaming=True)
    except Exception as error:  # datasets raises many kinds of error for an unreachable hub
        raise offline_hint("dataset", name, "tinytales", error) from error
    if "validation" in stream:
        return texts(stream[split], split)
    held_out = split == "validation"
    documents = enumerate(texts(stream["train"], "train"))
    return (text for i, text in documents if (i % HELD_OUT == HELD_OUT - 1) == held_out)


def texts(stream, split, text_column="text"):
    """The documents' texts, each checked to be one."""
    for number, document in enumerate(stream):
        text = document.get(text_column)
        if not isinstance(text, str):
            raise ValueError(
                f"the {split} split's document {number} has no text in a {text_column!r} "
                f"column: {document!r:.80}"
            )
        yield text


class StreamedRows:
    """The rows of a split read from a stream, tokenised as they are served: documents joined by
    end-of-text and cut into rows of T + 1 tokens, as in a folder of token shards, in the
    stream's order (no shuffle). `rows[indices]` takes increasing row numbers, which count on
    past the end of the stream: row i of a stream of n rows is row i mod n of the next pass.
    Every dp rank reads the whole stream and keeps its own rows, so the rows are those of one
    process. To go back (a resume, each validation's start), the stream is read again from its
    start and the rows before skipped: exact, at the cost of reading them again."""

    streamed = True

    def __init__(self, name, split, tokenizer, seq_len, batch=256):
        self.name, self.split, self.tokenizer = name, split, tokenizer
        self.row, self.batch = seq_len + 1, batch
        self.length = None  # rows in one pass, known once the stream has ended
        self.restart()

    def restart(self):
        self.documents = open_stream(self.name, self.split)
        self.buffer, self.next = [], 0  # tokens not yet in a row; the next row's number

    def read_row(self):
        """The next row of this pass, or None at the stream's end."""
        while len(self.buffer) < self.row:
            batch = [text for _, text in zip(range(self.batch), self.documents, strict=False)]
            if not batch:
                return None
            ids = self.tokenizer(batch, add_special_tokens=False)["input_ids"]
            self.buffer += [t for doc in ids for t in (*doc, self.tokenizer.eos_token_id)]
        row, self.buffer = self.buffer[: self.row], self.buffer[self.row :]
        return row

    def row_at(self, index):
        if self.length:
            index %= self.length
        if index < self.next:
            self.restart()
        while True:
            row = self.read_row()
            if row is None:  # the end of the stream: a pass's length is known
                if self.next == 0:
                    raise ValueError(
                        f"the {self.split} split of {self.name!r} is too small for one row of "
                        f"seq_len + 1 = {self.row} tokens"
                    )
                self.length, index = self.next, index % self.next
                self.restart()
                continue
            self.next += 1
            if self.next - 1 == index:
                return row

    def __getitem__(self, indices):
        return {"tokens": torch.tensor([self.row_at(i) for i in indices])}  # (B, T+1)


### end Streaming


def load_data(args, vocab_size):
    """--tokenizer_name, and --dataset_name's training and validation splits in rows of
    --seq_len + 1 tokens: tokenised here, or read from a folder of token shards. Every id must
    have a row in the model's embedding: checked here, before the first step."""
    tokenizer = load_tokenizer(args.tokenizer_name)
    shards = is_shard_folder(args.dataset_name)
    if args.streaming and shards:
        raise ValueError(
            f"--streaming reads a dataset as it comes; {args.dataset_name} is a folder of token "
            f"shards, which is read in place without it: drop --streaming"
        )
    if shards:
        index = read_shard_index(args.dataset_name, tokenizer, args.tokenizer_name)
        # A shards.json older than the record of its largest id: its tokenizer's bounds it (the
        # fingerprint says which tokenizer wrote it, the CRC-32s that its bytes are unchanged).
        largest = index.get("max_token_id", largest_id(tokenizer))
        what = f"--dataset_name {args.dataset_name} holds token ids up to {largest}"
        check_vocabulary(what, largest, vocab_size)
    check_tokenizer_ids(tokenizer, vocab_size)
    if args.streaming:
        train, validation = (
            StreamedRows(args.dataset_name, split, tokenizer, args.seq_len)
            for split in ("train", "validation")
        )
        train[[0]], validation[[0]]  # a stream that cannot give one row fails here, not later
        log(f"data {args.dataset_name}: streamed, its rows tokenised as they are served")
        return tokenizer, train, validation
    if shards:
        train, validation = load_shards(args, index)
    else:
        train, validation = load_splits(args.dataset_name, args.seed)
        train = tokenize(train, tokenizer, args.seq_len, args.num_proc)
        validation = tokenize(validation, tokenizer, args.seq_len, args.num_proc)
    log(f"data {args.dataset_name}: {len(train):,} training rows, {len(validation):,} validation")
    return tokenizer, train, validation


class MicroBatchDataLoader:
    """Serves (inputs, targets) micro-batches of B rows, forever: after the last row of an epoch
    it starts a new epoch in a new shuffled order instead of stopping."""

    def __init__(self, rows, micro_batch_size, seed, device, shuffle=True, dp_rank=0, dp_size=1):
        self.rows, self.micro_batch_size = rows, micro_batch_size
        self.seed, self.device, self.shuffle = seed, device, shuffle
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.position = 0  # rows served so far to all dp ranks, over all epochs
        self._order = (None, None)  # (epoch, permutation), the one epoch cached

    def order(self, epoch):
        if self._order[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 10_007 + epoch)
            perm = torch.randperm(len(self.rows), generator=generator)
            self._order = (epoch, perm if self.shuffle else torch.arange(len(self.rows)))
        return self._order[1]

    def index(self, position):
        """The row served at `position`: of its epoch's shuffled order; a stream's in order."""
        if getattr(self.rows, "streamed", False):
            return position
        epoch, i = divmod(position, len(self.rows))
        return self.order(epoch)[i].item()

    @property
    def epoch(self):
        return self.position // len(self.rows)

    def __iter__(self):
        return self

    def __next__(self):
        indices = []
        first = self.position + self.dp_rank * self.micro_batch_size  # skip lower dp ranks' rows
        for position in range(first, first + self.micro_batch_size):
            indices.append(self.index(position))
        self.position += self.dp_size * self.micro_batch_size
        tokens = self.rows[indices]["tokens"].to(self.device)  # (B, T+1)
        return tokens[:, :-1], tokens[:, 1:]  # inputs (B, T), targets (B, T)

    def state_dict(self):
        streamed = getattr(self.rows, "streamed", False)  # a stream's rows are not counted
        return {"position": self.position, "rows": None if streamed else len(self.rows)}

    def load_state_dict(self, state):
        """Go on from `position`. From data cut into another number of rows (another
        --dataset_name or --seq_len) that is another place in another order: said once."""
        rows = state.get("rows")  # a rewind to position 0 gives none, a stream's is None
        streamed = getattr(self.rows, "streamed", False)
        if rows is not None and not streamed and rows != len(self.rows):
            log(
                f"warning: the checkpoint's data had {rows:,} rows and this run's has "
                f"{len(self.rows):,} (another --dataset_name or --seq_len): training goes on "
                f"from row {state['position']:,} of this run's order, not where the checkpoint's "
                f"data stopped"
            )
        self.position = state["position"]
