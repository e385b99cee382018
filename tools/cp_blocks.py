"""Step 11's ring attention as a picture: which rank computes each (query chunk, key chunk) block
of causal attention, and at which ring step, from step 11's own `chunk_ids` and `blocks`.

    python tools/cp_blocks.py --cp_size 4
    python tools/cp_blocks.py --cp_size 4 --naive     # rank r holding chunks 2r and 2r + 1

The sequence is cut into 2 x cp chunks. Rank r holds the queries of its chunks; at ring step s it
holds the keys of rank r - s, and computes the blocks of its queries against them that causal
attention needs: a key chunk before the query chunk whole, the same chunk as a causal half
(marked '\\'), a later one not at all ('.').
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "step11_context_parallel"))
import context_parallel  # noqa: E402

HALF = "\\"  # the mark of a causal half block


def grid(cp_size):
    """{(query chunk, key chunk): (rank, ring step, causal half)} for every block computed."""
    found = {}
    for rank in range(cp_size):
        queries = context_parallel.chunk_ids(rank, cp_size)
        for step in range(cp_size):
            source = (rank - step) % cp_size
            keys = context_parallel.chunk_ids(source, cp_size)
            for i, j, causal in context_parallel.blocks(rank, source, cp_size):
                assert (queries[i], keys[j]) not in found, "a block computed twice"
                found[queries[i], keys[j]] = (rank, step, causal)
    return found


def draw(cp_size):
    found, n = grid(cp_size), 2 * cp_size
    work = [sum(1 for r, _, _ in found.values() if r == rank) for rank in range(cp_size)]
    lines = [
        f"cp {cp_size}: {n} chunks; rank r holds chunks {context_parallel.chunk_ids(0, cp_size)} "
        f"(rank 0) ... {context_parallel.chunk_ids(cp_size - 1, cp_size)} (rank {cp_size - 1})",
        "each block: the rank that computes it, then the ring step (\\ a causal half, . skipped)",
        "query \\ key " + "".join(f"{k:>5}" for k in range(n)),
    ]
    for q in range(n):
        cells = []
        for k in range(n):
            if (q, k) in found:
                rank, step, causal = found[q, k]
                cells.append(str(rank) + (HALF if causal else " ") + str(step))
            else:
                cells.append(".")
        lines.append(f"{q:>11} " + "".join(f"{cell:>5}" for cell in cells))
    steps = [
        [sum(1 for r, s, _ in found.values() if r == rank and s == step) for rank in range(cp_size)]
        for step in range(cp_size)
    ]
    lines.append(f"blocks per rank: {work}; per ring step, rank 0 first: {steps}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cp_size", type=int, default=4)
    parser.add_argument("--naive", action="store_true", help="rank r holds chunks 2r and 2r + 1")
    args = parser.parse_args(argv)
    if args.cp_size < 1:
        parser.error(f"--cp_size must be at least 1, got {args.cp_size}")
    if args.naive:
        context_parallel.chunk_ids = lambda rank, size: (2 * rank, 2 * rank + 1)
    print(draw(args.cp_size))


if __name__ == "__main__":
    main()
