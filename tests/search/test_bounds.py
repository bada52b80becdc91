import random

from mpipe_tune.search._bounds import BoundOrder


def test_the_bound_order_is_that_of_the_final_bounds_and_refines_only_what_comes_on_top():
    rng = random.Random(4)
    finals = [[rng.uniform(0, 1)] for _ in range(200)]
    for levels in finals:  # each candidate: looser bounds first, the last one final
        while rng.random() < 0.6:
            levels.insert(0, levels[0] * rng.uniform(0.5, 1.0))
    asked = []

    def bound_at(c, level):
        asked.append((c, level))
        return finals[c][level]

    order = BoundOrder(list(range(len(finals))), lambda c: (0, len(finals[c]) - 1), bound_at)
    seen = []
    while order and len(seen) < 20:
        low, index = order.peek()
        assert low == finals[index][-1]
        order.pop()
        seen.append(index)
    assert seen == sorted(range(len(finals)), key=lambda c: (finals[c][-1], c))[:20]
    refined = {c for c, level in asked if level > 0}
    assert len(refined) < len(finals) // 2  # the rest kept their first bound: never refined


def test_ties_go_to_the_first_listed():
    order = BoundOrder(["a", "b", "c"], lambda c: (0, 1), lambda c, level: {"a": 2.0, "b": 1.0, "c": 1.0}[c] * level)
    taken = []
    while order:
        taken.append(order.peek()[1])
        order.pop()
    assert taken == [1, 2, 0]
