"""Deep YAML never reaches libyaml's recursive composer: a PyYAML built on a libyaml without a nesting limit
overflows the C stack there (the process dies with a segfault), so a text that could nest deeper than the C path is
safe for goes to the Python parser, which stops at the recursion limit with one line."""

import pytest
import yaml

from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs import C_YAML_SAFE_DEPTH, nesting_bound, parse_text


@pytest.mark.parametrize("text, depth", [
    ("a: " + "[" * 3 + "]" * 3, 3),
    ("- " * 40 + "x", 40),
    ("a:\n" + "".join(" " * i + f"k{i}:\n" for i in range(1, 30)) + " " * 30 + "v", 30),
    ("s: ']]]]]'\nt: [[1]]", 2),
])
def test_the_bound_is_never_below_the_parsed_depth(text, depth):
    def deepest(node):
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        return 1 + max(map(deepest, children), default=0) if isinstance(node, (dict, list)) else 0

    assert deepest(yaml.safe_load(text)) >= depth
    assert nesting_bound(text) >= deepest(yaml.safe_load(text))


@pytest.mark.parametrize("text", ["a: " + "[" * 100000 + "]" * 100000, "- " * 100000 + "x",
                                  "a: " + "{b: " * 50000 + "1" + "}" * 50000])
def test_a_deep_file_is_one_line_not_a_crash(text, monkeypatch):
    assert nesting_bound(text) > C_YAML_SAFE_DEPTH

    def no_c_loader(*args, **kwargs):
        raise AssertionError("a text deeper than the C path is safe for reached libyaml")

    monkeypatch.setattr(yaml, "CSafeLoader", type("Refuses", (), {"__init__": no_c_loader}), raising=False)
    with pytest.raises(MpipeError, match="nests too deeply"):
        parse_text(text, "m.yaml", "model", as_json=False)


def test_an_ordinary_file_still_takes_the_fast_parser(monkeypatch):
    used = []
    real = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

    class Recording(real):
        def __init__(self, stream):
            used.append(True)
            super().__init__(stream)

    monkeypatch.setattr(yaml, "CSafeLoader", Recording, raising=False)
    assert parse_text("name: m\nlayers: [{a: 1}]\n", "m.yaml", "model", as_json=False) == {
        "name": "m", "layers": [{"a": 1}]}
    assert used
