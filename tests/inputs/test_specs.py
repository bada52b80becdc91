"""Model specs that compose other files: relative paths resolve against the composing file's folder."""

from __future__ import annotations

import pytest

from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs import load_model

BLOCK = "layers: [{name: blk, block: llm, fwd_s_per_token: 1.0e-6, bwd_s_per_token: 2.0e-6, repeat: 3}]\n"


def write_tree(root):
    (root / "parts" / "deeper").mkdir(parents=True)
    (root / "parts" / "deeper" / "block.yaml").write_text(f"name: block\n{BLOCK}")
    (root / "parts" / "backbone.yaml").write_text("name: backbone\ncompose: [deeper/block.yaml, deeper/block.yaml]\n")
    (root / "mllm.yaml").write_text("name: mllm\ncompose: [parts/backbone.yaml, parts/deeper/block.yaml]\n")
    return root / "mllm.yaml"


def test_relative_composes_resolve_against_each_files_folder_from_any_working_folder(tmp_path, monkeypatch):
    path = write_tree(tmp_path / "models")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    model = load_model(path)
    assert model.num_layers == 9  # backbone (2 x 3, nested one folder deeper) + 3
    monkeypatch.chdir(tmp_path / "models")
    assert load_model("mllm.yaml").num_layers == 9


def test_a_missing_composed_file_names_where_it_was_looked_up(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("name: m\ncompose: [parts/nothing.yaml]\n")
    with pytest.raises(MpipeError, match="folder of the file that composes it"):
        load_model(path)


def test_built_in_models_load_from_a_source_checkout_on_the_path():
    """A checkout put first on sys.path (``PYTHONPATH=.``, or a benchmark script that adds its checkout)
    beside a regular, non-editable install: ``mpipe_tune`` comes from the checkout, which has no
    ``mpipe_tune/models`` package (the built-ins live in ``models/``), as the profiles' lookup knows."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = (  # no editable finder: mpipe_tune.models resolves only through the checkout's own folders
        "import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'Editable' not in repr(f)]; "
        f"sys.path.insert(0, {str(root)!r}); "
        "from mpipe_tune.inputs._specs import builtin_models, load_model; "
        "print(len(builtin_models()), load_model('example-mllm').num_layers)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-800:]
    count, layers = done.stdout.split()
    assert int(count) == len(list((root / "models").glob("*.yaml"))) and int(layers) == 25


def test_an_empty_model_file_says_it_is_empty(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("")
    with pytest.raises(MpipeError, match=r"m\.yaml: the file is empty; a model file is a mapping with 'name'"):
        load_model(path)  # it said '... got NoneType', YAML's reading of an empty file
