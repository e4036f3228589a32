"""DDTree construction and walk: the spec's hand example and the heap against brute force."""

from __future__ import annotations

import itertools
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from remote.ddtree import build_tree, path_score, walk_tree


def _brute_force(logprobs: list[list[float]], budget: int) -> set[tuple[int, ...]]:
    """Every rank path, sorted by the documented key (-score, depth, path); the first `budget`."""
    width = [min(budget, len(row)) for row in logprobs]
    paths = []
    for depth in range(1, len(logprobs) + 1):
        paths += itertools.product(*[range(1, width[d] + 1) for d in range(depth)])
    paths.sort(key=lambda p: (-path_score(logprobs, p), len(p), p))
    return set(paths[:budget])


def test_spec_example_budget_one_and_two() -> None:
    # depth-1 probabilities [0.5, 0.4, 0.1], depth-2 top-1 0.5; the truth at depth 1 is the rank-2 token.
    logprobs = [[math.log(0.5), math.log(0.4), math.log(0.1)], [math.log(0.5), math.log(0.3), math.log(0.2)]]
    ids = [[10, 11, 12], [20, 21, 22]]
    truth = [11, 20]
    tree1 = build_tree(logprobs, 1)
    assert tree1 == {(1,)}
    assert walk_tree(tree1, ids, truth, limit=2) == 0  # tau 1
    tree2 = build_tree(logprobs, 2)
    assert tree2 == {(1,), (2,)}  # 0.4 > 0.5 * 0.5
    assert walk_tree(tree2, ids, truth, limit=2) == 1  # tau 2
    # Budget 4 adds (1,1) at 0.25 and (2,1) at 0.2: the walk continues to depth 2.
    assert build_tree(logprobs, 4) == {(1,), (2,), (1, 1), (2, 1)}
    assert walk_tree(build_tree(logprobs, 4), ids, truth, limit=2) == 2
    assert walk_tree(build_tree(logprobs, 4), ids, truth, limit=1) == 1  # W_a caps the walk


def test_depth_cap_and_width_cap() -> None:
    logprobs = [[0.0, -5.0]] * 4  # a sure chain: budget 3 goes straight down
    assert build_tree(logprobs, 3) == {(1,), (1, 1), (1, 1, 1)}
    assert build_tree(logprobs, 3, max_depth=2) == {(1,), (1, 1), (2,)}
    # Only min(B, K) candidates per depth exist: a one-candidate table cannot widen.
    assert build_tree([[-0.1], [-0.1]], 5) == {(1,), (1, 1)}


# Few distinct values so that equal scores (ties) are frequent.
_VALUES = st.sampled_from([0.0, -0.25, -0.5, -1.0, -1.5, -3.0])


@st.composite
def _tables(draw):
    depth = draw(st.integers(1, 4))
    vocab = draw(st.integers(1, 5))
    rows = [sorted(draw(st.lists(_VALUES, min_size=vocab, max_size=vocab)), reverse=True) for _ in range(depth)]
    return rows, draw(st.integers(1, 14))


@settings(max_examples=300, deadline=None)
@given(_tables())
def test_heap_equals_brute_force(case) -> None:
    logprobs, budget = case
    tree = build_tree(logprobs, budget)
    assert tree == _brute_force(logprobs, budget)
    for path in tree:  # every prefix of a kept path is kept
        assert all(path[:i] in tree for i in range(1, len(path)))


@settings(max_examples=200, deadline=None)
@given(_tables(), st.data())
def test_walk_follows_truth_prefix(case, data) -> None:
    logprobs, budget = case
    depth, vocab = len(logprobs), len(logprobs[0])
    ids = [list(range(100 * d, 100 * d + vocab)) for d in range(depth)]
    truth = [data.draw(st.integers(100 * d, 100 * d + vocab)) for d in range(depth)]  # may be absent
    tree = build_tree(logprobs, budget)
    expected = 0
    for d in range(depth):
        rank = truth[d] - 100 * d + 1
        if rank > vocab or tuple(t - 100 * i + 1 for i, t in enumerate(truth[:d + 1])) not in tree:
            break
        expected += 1
    assert walk_tree(tree, ids, truth, depth) == expected
