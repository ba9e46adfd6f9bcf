"""Launching several ranks from a test: `torchrun` (its elastic agent watches the ranks), or plain
processes given the variables torchrun gives its workers (as `srun` or `mpirun` start them, with
no agent to stop the others when one fails)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from runtime.dist import free_port

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}


def torchrun(nproc: int, *args, timeout: int = 300, env: dict | None = None
             ) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node nproc ARGS` in the repository root (`env`: variables added to
    `ENV`); asserts it succeeded."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", *map(str, args)]
    done = subprocess.run(cmd, cwd=ROOT, env={**ENV, **(env or {})}, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def bare_ranks(nproc: int, *args) -> list[subprocess.Popen]:
    """`python ARGS` as ranks 0..nproc-1 of one job, without an agent; the caller waits."""
    port = str(free_port())
    return [subprocess.Popen([sys.executable, *map(str, args)], cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             env={**ENV, "RANK": str(r), "LOCAL_RANK": str(r),
                                  "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
                                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
            for r in range(nproc)]
