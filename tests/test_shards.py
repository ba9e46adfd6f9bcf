"""runtime/shards.py and the distributed setup: chunks dealt to ranks by cost, each chunk's
randomness its own, and the process group's timeout from the config."""

import json
import subprocess
import sys

import torch

from launch import ENV, ROOT
from runtime.shards import chunk_seed, deal, map_chunks, seeded


def test_deal_balances_by_cost_where_round_robin_does_not():
    # Labelling shards of 5, 1, 1, 1, 1 and 1 prefixes on 2 ranks. Round robin (shards 0, 2, 4
    # and 1, 3, 5) loads the ranks 7 and 3; by cost the big shard goes alone: 5 and 5.
    costs = [5, 1, 1, 1, 1, 1]
    dealt = deal(costs, 2)
    assert dealt == [[0], [1, 2, 3, 4, 5]]
    assert sorted(sum(costs[i] for i in items) for items in dealt) == [5, 5]
    assert sorted(i for items in dealt for i in items) == list(range(6))
    assert deal([1.0] * 5, 1) == [[0, 1, 2, 3, 4]]
    assert deal([], 3) == [[], [], []]


def test_a_chunk_samples_the_same_whatever_ran_before_and_leaves_the_rng_alone():
    def draw(chunk: int):
        return torch.rand(3)

    torch.manual_seed(1)
    first = map_chunks(4, draw, seed_key=("eval", 0))
    after = torch.rand(1)
    torch.manual_seed(2)
    torch.rand(100)
    second = map_chunks(4, draw, seed_key=("eval", 0))
    torch.manual_seed(1)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert not torch.equal(first[0], first[1])  # each chunk has its own stream
    assert torch.equal(torch.rand(1), after)  # the chunks did not move the caller's RNG
    with seeded("eval", 0, 2):
        assert torch.equal(torch.rand(3), first[2])
    assert chunk_seed("eval", 0, 2) == chunk_seed("eval", 0, 2) != chunk_seed("eval", 1, 2)


def test_the_process_group_waits_as_long_as_the_config_says():
    """`run.dist_timeout_minutes` reaches the process group (DeepSpeed's default: 10 minutes)."""
    code = ("import json, torch, torch.distributed as dist\n"
            "from runtime.dist import init_distributed\n"
            "init_distributed(7.5)\n"
            "backend = dist.group.WORLD._get_backend(torch.device('cpu'))\n"
            "print(json.dumps(backend.options._timeout.total_seconds()))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == 450.0
