"""Work spread over the ranks: a phase that only generates or scores (evaluation, best-of-N,
sampling for labels, a reward model's validation) cuts its inputs into chunks, deals them to the
ranks by cost, runs each chunk under a random state seeded from the chunk's own key, and gathers
the results in chunk order on every rank. So N processes compute what one computes, each doing
about 1/N of the work, and no rank waits in a collective while another works alone (at the
paper's sizes such a wait outlasts a process group's timeout).

    results = map_chunks(len(chunks), lambda c: work(chunks[c]), seed_key=("eval", seed))

Every rank must call `map_chunks` with the same chunks (it ends in a collective).
"""

from __future__ import annotations

import contextlib
import heapq
import zlib
from typing import Callable, Iterator, Sequence, TypeVar

from runtime.dist import gather_objects, world

T = TypeVar("T")


def deal(costs: Sequence[float], ranks: int) -> list[list[int]]:
    """Item indices for each of `ranks` ranks, balanced by cost: the costliest item first goes
    to the least loaded rank (ties: the lower rank), so the largest load is at most the mean
    load plus one item. Each rank's indices come back in ascending order."""
    loads = [(0.0, r) for r in range(ranks)]
    dealt: list[list[int]] = [[] for _ in range(ranks)]
    for item in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(loads)
        dealt[rank].append(item)
        heapq.heappush(loads, (load + costs[item], rank))
    return [sorted(items) for items in dealt]


def chunk_seed(*key) -> int:
    """A 31-bit seed from a key of strings and numbers (stable across processes and runs)."""
    return zlib.crc32(":".join(map(str, key)).encode()) & 0x7FFF_FFFF


@contextlib.contextmanager
def seeded(*key) -> Iterator[None]:
    """Torch's random state (CPU, and the current GPU's) seeded from `key` inside the block and
    restored after it: what the block samples depends on its key alone, not on what ran
    before it in the process or on which rank it runs."""
    import torch

    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(chunk_seed(*key))
        yield


def my_chunks(costs: Sequence[float]) -> list[int]:
    """The chunks `map_chunks` deals to this rank (for a progress bar's total)."""
    rank, size = world()
    return deal(costs, size)[rank]


def map_chunks(n: int, work: Callable[[int], T], *, costs: Sequence[float] | None = None,
               seed_key: tuple | None = None, done: Callable[[int], None] | None = None
               ) -> list[T]:
    """[work(0), ..., work(n - 1)] on every rank, each chunk computed by one rank: the chunks
    are dealt by `costs` (default: equal), and with `seed_key` each runs under
    `seeded(*seed_key, chunk)`. `done(chunk)` is called on the rank that computed it (a
    progress bar). Every rank must call it (the results are gathered)."""
    mine = my_chunks(list(costs) if costs is not None else [1.0] * n)
    results: dict[int, T] = {}
    for chunk in mine:
        context = seeded(*seed_key, chunk) if seed_key is not None else contextlib.nullcontext()
        with context:
            results[chunk] = work(chunk)
        if done is not None:
            done(chunk)
    if world()[1] > 1:
        results = {c: r for part in gather_objects(results) for c, r in part.items()}
    return [results[c] for c in range(n)]
