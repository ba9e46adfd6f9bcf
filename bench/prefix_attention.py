"""One decoding step's attention with a shared prompt: SDPA over every row's full cache against
reading the prompt's keys and values once per group (the G samples of a question, or a step
prefix's N continuations, share them), at the shapes of batched labelling on the tiny model.

    python bench/prefix_attention.py [--rows 256] [--group 8] [--prefix 150] [--length 200]

Checks that both give the same output (1e-5), then prints ms per call and the ratio.
"""

import argparse
import time

import torch
import torch.nn.functional as F


def shared_prefix_attention(q, k_prefix, v_prefix, k_own, v_own, group: int) -> torch.Tensor:
    """softmax(q [K_prefix | K_own]) [V_prefix | V_own] with the prefix stored once per group:
    q [B, H, 1, D]; k_prefix, v_prefix [B / group, H, P, D]; k_own, v_own [B, H, L - P, D]."""
    rows, heads, _, dim = q.shape
    groups, prefix = rows // group, k_prefix.shape[2]
    grouped = q.view(groups, group, heads, dim).transpose(1, 2)  # a group's queries together
    scores_prefix = (grouped @ k_prefix.transpose(-1, -2)).transpose(1, 2).reshape(
        rows, heads, 1, prefix)
    scores = torch.cat([scores_prefix, q @ k_own.transpose(-1, -2)], -1) / dim ** 0.5
    weights = scores.softmax(-1)
    from_prefix = weights[..., :prefix].reshape(groups, group, heads, prefix).transpose(1, 2)
    out_prefix = (from_prefix @ v_prefix).transpose(1, 2).reshape(rows, heads, 1, dim)
    return out_prefix + weights[..., prefix:] @ v_own


def _ms(fn, repeats: int = 30) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--prefix", type=int, default=150)
    parser.add_argument("--length", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    shape = lambda rows, length: (rows, args.heads, length, args.dim)  # noqa: E731
    q = torch.randn(shape(args.rows, 1), generator=gen)
    k_prefix = torch.randn(shape(args.rows // args.group, args.prefix), generator=gen)
    v_prefix = torch.randn(shape(args.rows // args.group, args.prefix), generator=gen)
    k_own = torch.randn(shape(args.rows, args.length - args.prefix), generator=gen)
    v_own = torch.randn(shape(args.rows, args.length - args.prefix), generator=gen)
    # The same keys and values as every row's own full cache (what the decoding loop holds).
    k = torch.cat([k_prefix.repeat_interleave(args.group, 0), k_own], 2)
    v = torch.cat([v_prefix.repeat_interleave(args.group, 0), v_own], 2)
    mask = torch.ones(args.rows, 1, 1, args.length, dtype=torch.bool)
    full = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # noqa: E731
    shared = lambda: shared_prefix_attention(  # noqa: E731
        q, k_prefix, v_prefix, k_own, v_own, args.group)
    torch.testing.assert_close(shared(), full(), atol=1e-5, rtol=1e-5)
    a, b = _ms(full), _ms(shared)
    print(f"{args.rows} rows, groups of {args.group}, prefix {args.prefix} of {args.length}: "
          f"SDPA {a:.2f} ms, shared prefix {b:.2f} ms ({b / a:.2f}x)")


if __name__ == "__main__":
    main()
