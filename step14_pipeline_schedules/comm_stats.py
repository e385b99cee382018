"""A ledger of communication: every collective and send/receive made while it is active, by
process group and kind, with how many calls and how many bytes.

    with CommStats(pgm) as stats:  # around one training step
        ...
    log(stats.table(), all_ranks=True)  # each rank's own: pipeline stages differ
    record["comm"] = stats.as_dict()

While active it replaces the functions of torch.distributed that the steps call (`dist.all_reduce`
...) by wrappers that write the call down and then make it unchanged, so nothing computed
changes; on exit, even by an exception, the originals are back. Object collectives
(`all_gather_object`, for logs and checkpoints, outside the step) and barriers are not counted.

Two byte counts per row. "bytes": the tensors the calls carry (numel x element size; for an
all-gather or a reduce-scatter the full tensor, all ranks' shards). "sent": what this rank puts on
the wire under the ring algorithms of NCCL and gloo, n ranks in the group:

    all-reduce       2 (n-1)/n x bytes: a reduce-scatter, then an all-gather
    reduce-scatter   (n-1)/n x bytes: n-1 steps, each passing on one shard
    all-gather       (n-1)/n x bytes
    broadcast        (n-1)/n x bytes: along a chain every rank but the last passes the tensor
                     on, n-1 copies in all; the average per rank
    send             bytes; recv sends nothing
    all-to-all       bytes less this rank's own piece, which stays (the pieces may differ in
                     size, each as the call says)

So a group of one rank sends nothing: its calls are listed, with 0 sent. A send or receive
addressed by global rank (on the default group) is listed under the axis that joins the two
ranks: "pp" for the neighbours of a pipeline. Groups that the manager does not name are listed by
their ranks.
"""

import functools
import inspect

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d  # where the originals live, never patched

# The functions wrapped: (kind, the argument whose bytes the call carries).
CALLS = {
    "all_reduce": ("all-reduce", "tensor"),
    "all_gather": ("all-gather", "tensor_list"),
    "all_gather_into_tensor": ("all-gather", "output_tensor"),
    "all_gather_single": ("all-gather", "output_tensor"),
    "reduce_scatter_tensor": ("reduce-scatter", "input"),
    "reduce_scatter_single": ("reduce-scatter", "input"),
    "broadcast": ("broadcast", "tensor"),
    "send": ("send", "tensor"),
    "isend": ("send", "tensor"),
    "recv": ("recv", "tensor"),
    "irecv": ("recv", "tensor"),
    "all_to_all_single": ("all-to-all", "input"),
}
AXES = ["tp", "pp", "dp"]  # the grid's axes, fastest first: their rows come first, in this order
KINDS = ["all-reduce", "reduce-scatter", "all-gather", "broadcast", "send", "recv", "all-to-all"]


def sent_fraction(kind, n):
    """The bytes this rank sends, as a fraction of the bytes of the call (table above)."""
    return {
        "all-reduce": 2 * (n - 1) / n,
        "reduce-scatter": (n - 1) / n,
        "all-gather": (n - 1) / n,
        "broadcast": (n - 1) / n,
        "send": 1,
        "recv": 0,
    }[kind]


def kept(call, size):
    """Of an all-to-all's input (`size` bytes), the bytes of the piece this rank sends itself."""
    group = call.get("group")
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    splits = call.get("input_split_sizes")
    if not splits:  # equal pieces
        return size // n
    return size * splits[rank] // max(sum(splits), 1)


def nbytes(tensors):
    tensors = tensors if isinstance(tensors, (list, tuple)) else [tensors]
    return sum(t.numel() * t.element_size() for t in tensors)


class P2POp(c10d.P2POp):
    """torch's P2POp accepts only its own isend and irecv: given a wrapper, it gets the original,
    so that `batch_isend_irecv` (wrapped itself) records each op once."""

    def __new__(cls, op, *args, **kwargs):
        return super().__new__(cls, getattr(c10d, op.__name__), *args, **kwargs)

    def __init__(self, op, *args, **kwargs):
        super().__init__(getattr(c10d, op.__name__), *args, **kwargs)


class CommStats:
    """Counts calls and bytes per (group, kind) while active. `pgm`: the ProcessGroupManager
    whose groups (its `<name>_group`s) name the rows (None: only "world" and ranks)."""

    def __init__(self, pgm=None):
        named = {} if pgm is None else vars(pgm)
        found = {k.removesuffix("_group"): g for k, g in named.items() if k.endswith("_group")}
        found = {name: group for name, group in found.items() if group is not None}
        names = [axis for axis in AXES if axis in found] + [n for n in found if n not in AXES]
        # (name, group, its global ranks): the grid's axes, then the manager's other groups
        self.groups = [
            (name, found[name], dist.get_process_group_ranks(found[name])) for name in names
        ]
        self.rows = {}  # (group name, kind): {"size", "calls", "bytes"}
        self.saved = {}

    def __enter__(self):
        names = [name for name in CALLS if hasattr(dist, name)]
        names += ["batch_isend_irecv", "P2POp"]
        self.saved = {name: getattr(dist, name) for name in names}
        for name in CALLS:
            if name in self.saved:
                setattr(dist, name, self.wrap(name, self.saved[name]))
        dist.batch_isend_irecv = self.wrap_batch(self.saved["batch_isend_irecv"])
        dist.P2POp = P2POp
        return self

    def __exit__(self, *exc):
        for name, function in self.saved.items():
            setattr(dist, name, function)
        return False

    def wrap(self, name, function):
        kind, argument = CALLS[name]
        signature = inspect.signature(function)

        @functools.wraps(function)
        def recorded(*args, **kwargs):
            call = signature.bind(*args, **kwargs).arguments
            peer = call.get("dst", call.get("src"))  # a global rank, for send and receive
            size = nbytes(call[argument])
            mine = kept(call, size) if kind == "all-to-all" else 0
            self.record(kind, call.get("group"), size, peer, mine)
            return function(*args, **kwargs)

        return recorded

    def wrap_batch(self, function):
        @functools.wraps(function)
        def recorded(ops):
            for op in ops:
                kind = "send" if op.op.__name__ == "isend" else "recv"
                self.record(kind, op.group, nbytes(op.tensor), op.peer)
            return function(ops)

        return recorded

    def record(self, kind, group, size, peer=None, kept=0):
        """`kept`: of an all-to-all's bytes, those of this rank's own piece."""
        name, group = self.name(group, peer)
        row = self.rows.setdefault((name, kind), {"size": 0, "calls": 0, "bytes": 0, "kept": 0})
        row["size"] = dist.get_world_size(group)
        row["calls"] += 1
        row["bytes"] += size
        row["kept"] += kept

    def name(self, group, peer):
        """(the row's name, its group) for a call on `group`, `peer` its global peer rank."""
        for name, known, _ in self.groups:
            if group is known:
                return name, group
        if group is None or group is dist.group.WORLD:
            for name, known, ranks in self.groups:
                if peer in ranks:
                    return name, known  # the axis that joins this rank and its peer
            return "world", dist.group.WORLD
        return "ranks " + ",".join(map(str, dist.get_process_group_ranks(group))), group

    def as_dict(self):
        """{group: {kind: {"calls", "bytes", "sent"}}}, JSON-able, for the metrics log."""

        names = [name for name, _, _ in self.groups]

        def order(key):  # the manager's groups first, as listed in self.groups; then the others
            name, kind = key
            return names.index(name) if name in names else len(names), name, KINDS.index(kind)

        out = {}
        for (name, kind), row in sorted(self.rows.items(), key=lambda item: order(item[0])):
            if kind == "all-to-all":
                sent = row["bytes"] - row["kept"]
            else:
                sent = round(row["bytes"] * sent_fraction(kind, row["size"]))
            out.setdefault(name, {})[kind] = {
                "calls": row["calls"],
                "bytes": row["bytes"],
                "sent": sent,
            }
        return out

    def table(self):
        """One line per group and kind, under a header naming this rank; returned, to be logged."""
        lines = [
            f"rank {dist.get_rank()} communication (sent: by this rank, under the ring algorithm)",
            f"{'group':<10} {'size':>4}  {'kind':<14} {'calls':>6} {'bytes':>14} {'sent':>14}",
        ]
        sizes = {name: row["size"] for (name, _), row in self.rows.items()}
        for name, kinds in self.as_dict().items():
            for kind, row in kinds.items():
                lines.append(
                    f"{name:<10} {sizes[name]:>4}  {kind:<14} {row['calls']:>6} "
                    f"{row['bytes']:>14,} {row['sent']:>14,}"
                )
        if not self.rows:
            lines.append("(no communication)")
        return "\n".join(lines)
