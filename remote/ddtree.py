"""DDTree: the draft tree of a budget B built from per-depth top-K log-probabilities, and its walk.

EVAL-SPEC section 3. A DFlash drafter drafts every slot of a block at once, so the distribution at
depth d does not depend on the path above it: a tree node is identified by its *rank path*
`(r_1, ..., r_d)` (1-based ranks into the per-depth candidate lists, best first) and its score is
`sum_i log q_i(r_i)`. The tree of budget B holds the B best non-root nodes, found best-first with a
heap: start at (depth 1, rank 1); each pop adds that node and pushes its next sibling and its first
child.

Tie-break (explicit so the heap equals brute force bit for bit): nodes are ordered by the key
`(-score, depth, rank_path)`, i.e. higher score first, then the shallower node, then the
lexicographically smaller rank path. A node's parent and previous sibling always come strictly
before it under this key (log q <= 0 and candidates are sorted descending), so the heap pops nodes
in exact key order and the tree is the first B nodes of the key-sorted list of all rank paths,
closed under prefixes. Scores are summed left to right in float64 in both, so ties are exact.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

RankPath = tuple[int, ...]


def path_score(logprobs: Sequence[Sequence[float]], path: RankPath) -> float:
    """Score of a rank path: sum over depths of log q_d(rank), summed left to right in float64."""
    score = 0.0
    for depth, rank in enumerate(path):
        score += float(logprobs[depth][rank - 1])
    return score


def build_tree(logprobs: Sequence[Sequence[float]], budget: int, max_depth: int | None = None) -> set[RankPath]:
    """The DDTree of `budget` non-root nodes, as a set of rank paths.

    `logprobs[d][r]` is the log-probability of the (r+1)-th best candidate at depth d+1, each row
    sorted descending; the number of candidates per depth is min(budget, len(row)). Depth is capped
    at `max_depth` (default: the number of rows).
    """
    depths = len(logprobs) if max_depth is None else min(max_depth, len(logprobs))
    if budget <= 0 or depths == 0:
        return set()
    width = [min(budget, len(logprobs[d])) for d in range(depths)]
    if width[0] == 0:
        return set()
    tree: set[RankPath] = set()
    first: RankPath = (1,)
    heap: list[tuple[float, int, RankPath, float]] = []
    # Entries carry the prefix score of the path's parent so every score is the exact left-to-right sum.
    heapq.heappush(heap, (-float(logprobs[0][0]), 1, first, 0.0))
    while heap and len(tree) < budget:
        neg_score, depth, path, parent_score = heapq.heappop(heap)
        tree.add(path)
        rank = path[-1]
        if rank < width[depth - 1]:
            sibling = path[:-1] + (rank + 1,)
            score = parent_score + float(logprobs[depth - 1][rank])
            heapq.heappush(heap, (-score, depth, sibling, parent_score))
        if depth < depths and width[depth] > 0:
            child = path + (1,)
            score = -neg_score + float(logprobs[depth][0])
            heapq.heappush(heap, (-score, depth + 1, child, -neg_score))
    return tree


def walk_tree(tree: set[RankPath], ids: Sequence[Sequence[int]], truth: Sequence[int], limit: int) -> int:
    """Number of nodes walked: at depth d follow the child whose token is `truth[d-1]`.

    `ids[d][r]` is the token of rank r+1 at depth d+1; the walk stops when no child of the current
    node holds the truth or after `limit` depths (the slots with known truth, W_a).
    """
    path: RankPath = ()
    walked = 0
    for depth in range(min(limit, len(ids), len(truth))):
        row = ids[depth]
        target = truth[depth]
        step = None
        for rank, token in enumerate(row):
            if token == target:
                step = path + (rank + 1,)
                break
        if step is None or step not in tree:
            break
        path = step
        walked += 1
    return walked
