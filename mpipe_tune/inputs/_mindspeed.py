"""A MindSpeed-MM layout as the user runs it: its model.json's pipeline split and its launch arguments.

MindSpeed-MM (Ascend/MindSpeed-MM) reads a VLM's pipeline split from the ``--mm-model`` model.json:
``image_encoder.vision_encoder.pipeline_num_layers`` and ``text_decoder.pipeline_num_layers``, one
count per pipeline stage, or with virtual stages ``v`` lists of ``P`` counts (chunk-major: rank r's
chunk j is global stage ``j x P + r``). The parallel degrees come from the launch script's Megatron
arguments (``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``,
``--virtual-pipeline-model-parallel-size``, ``--context-parallel-size``, ``--micro-batch-size``,
``--global-batch-size``, ``--recompute-granularity``), given as the flags themselves or as the launch
script, whose simple variable assignments (``TP=2``, ``DP=$(($WORLD_SIZE/$TP/$PP))``) are resolved.

:func:`read_mindspeed_layout` reads both into one :class:`MindSpeedLayout`; every bad value is one
:class:`~mpipe_tune.errors.MpipeError` line naming the file, the key and what must hold.
"""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs import parse_json, path_problem, read_text, shown

FLAGS = {
    "--tensor-model-parallel-size": "tp",
    "--pipeline-model-parallel-size": "pp",
    "--virtual-pipeline-model-parallel-size": "vpp",
    "--context-parallel-size": "cp",
    "--micro-batch-size": "micro_batch_size",
    "--global-batch-size": "global_batch_size",
    "--recompute-granularity": "recompute",
}
"""The launch arguments read, and the field each sets."""
MAX_STAGES = 4096
"""The most pipeline stages (chunks x ranks) a ``pipeline_num_layers`` may list."""
MAX_EXPRESSION_CHARS = 256
"""The longest ``$((...))`` expression a launch script's variable is evaluated from."""
VISION_OUTSIDE_KINDS = ("patch_embed", "merger")
"""Vision-encoder layer kinds that MindSpeed-MM does not count in ``vision_encoder.num_layers``: the patch
embedding runs in the first vision stage, a patch merger (Qwen2-VL's) is its ``vision_projector`` after the
last (``examples/qwen2.5vl/model_7b.json`` at 57069cd5: 32 vision layers)."""
DECODER_OUTSIDE_KINDS = ("embedding", "lm_head")
"""Text-decoder layer kinds not counted in ``text_decoder.num_layers``: its embedding and output layer."""


@dataclass(frozen=True)
class MindSpeedLayout:
    """A MindSpeed-MM run's layout: per global pipeline stage (in stage order), its layer counts."""

    pp: int
    num_chunks: int
    """Virtual stages per rank (``--virtual-pipeline-model-parallel-size``; 1 without VPP)."""
    vision_layers: tuple[int, ...]
    """Per global stage, its vision transformer layers (all zero for a model without an image encoder)."""
    decoder_layers: tuple[int, ...]
    """Per global stage, its text decoder layers."""
    tp: int = 1
    cp: int = 1
    micro_batch_size: int = 1
    global_batch_size: int | None = None
    """Sequences per step over all replicas; None: not given."""
    recompute: bool | str = False
    """``True`` (full), ``"selective"`` or ``False``: the launch arguments', else the text decoder's model.json."""
    frozen_modules: tuple[str, ...] = ()
    """The model.json's modules with ``"freeze": true`` (``image_encoder.vision_encoder``, ...), in file order."""


def read_mindspeed_layout(model_json: str | Path, launch_args: str | None = None) -> MindSpeedLayout:
    """The layout of ``model_json`` with the degrees of ``launch_args`` (the flags, or a launch script's path)."""
    where = f"MindSpeed-MM model.json {model_json}"
    config = _load_json(model_json, where)
    text = config.get("text_decoder")
    if not isinstance(text, dict) or "pipeline_num_layers" not in text:
        raise MpipeError(f"{where}: text_decoder.pipeline_num_layers is missing; a MindSpeed-MM model.json lists the "
                         f"text decoder's layers per pipeline stage there, e.g. [1, 10, 10, 7]")
    decoders, pp, chunks = _counts(text["pipeline_num_layers"], where, "text_decoder")
    image = config.get("image_encoder")
    vision = tuple(0 for _ in decoders)
    if isinstance(image, dict) and isinstance(image.get("vision_encoder"), dict):
        encoder = image["vision_encoder"]
        if "pipeline_num_layers" in encoder:
            vision, vpp, vchunks = _counts(encoder["pipeline_num_layers"], where, "image_encoder.vision_encoder")
            if (vpp, vchunks) != (pp, chunks):
                raise MpipeError(f"{where}: image_encoder.vision_encoder.pipeline_num_layers has {vchunks} x {vpp} "
                                 f"stages and text_decoder.pipeline_num_layers {chunks} x {pp}; give both the same "
                                 f"shape (one count per pipeline stage)")
        _check_sum(encoder, vision, where, "image_encoder.vision_encoder")
    _check_sum(text, decoders, where, "text_decoder")
    values: dict[str, Any] = {"recompute": _recompute(text.get("recompute_granularity")),
                              "frozen_modules": _frozen_modules(config)}
    if launch_args is not None:
        values.update(_read_args(launch_args))
    if values.get("pp", pp) != pp:
        raise MpipeError(f"{where}: the launch arguments give --pipeline-model-parallel-size {values['pp']}, but "
                         f"pipeline_num_layers lists {pp} stages per chunk; make them agree")
    if values.get("vpp", chunks) != chunks:
        raise MpipeError(f"{where}: the launch arguments give --virtual-pipeline-model-parallel-size {values['vpp']}, "
                         f"but pipeline_num_layers lists {chunks} chunk(s); make them agree")
    values.pop("pp", None)
    values.pop("vpp", None)
    return MindSpeedLayout(pp=pp, num_chunks=chunks, vision_layers=vision, decoder_layers=decoders, **values)


def _frozen_modules(config: dict[str, Any]) -> tuple[str, ...]:
    """The dotted names of the model.json's modules that set ``"freeze": true`` (MindSpeed-MM freezes their
    parameters), one level below the top and the top level's own."""
    out = []
    for name, module in config.items():
        if isinstance(module, dict):
            out += [name] * (module.get("freeze") is True)
            out += [f"{name}.{sub}" for sub, part in module.items() if isinstance(part, dict) and part.get("freeze") is True]
    return tuple(out)


def is_model_json(text: str) -> bool:
    """Whether a ``--current`` value names a JSON file (a MindSpeed-MM model.json) rather than a layout text."""
    return text.strip().lower().endswith(".json") and "=" not in text


def _load_json(path: str | Path, where: str) -> dict[str, Any]:
    config = parse_json(read_text(path, "MindSpeed-MM model.json"), where, "model.json")
    if not isinstance(config, dict):
        raise MpipeError(f"{where} holds no JSON object; a MindSpeed-MM model.json is one object")
    return config


def _counts(value: Any, where: str, key: str) -> tuple[tuple[int, ...], int, int]:
    """(counts per global stage in stage order, P, v) of one ``pipeline_num_layers``."""
    def is_count(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    if isinstance(value, list) and (len(value) > MAX_STAGES or sum(len(r) for r in value if isinstance(r, list)) > MAX_STAGES):
        raise MpipeError(f"{where}: {key}.pipeline_num_layers lists more than {MAX_STAGES} stages "
                         f"({shown(value)}); give one count per pipeline stage")
    if isinstance(value, list) and value and all(is_count(x) for x in value):
        return tuple(value), len(value), 1
    if (isinstance(value, list) and value and all(isinstance(row, list) and row for row in value)
            and len({len(row) for row in value}) == 1 and all(is_count(x) for row in value for x in row)):
        return tuple(x for row in value for x in row), len(value[0]), len(value)
    raise MpipeError(f"{where}: {key}.pipeline_num_layers is {shown(value)}; give a list of layer counts per stage "
                     f"([1, 10, 10, 7]) or, with virtual stages, equal-length lists of them ([[0, 0, 1], [4, 4, 4]])")


def _check_sum(module: dict[str, Any], counts: tuple[int, ...], where: str, key: str) -> None:
    num_layers = module.get("num_layers")
    if num_layers is not None and (isinstance(num_layers, bool) or not isinstance(num_layers, int)):
        raise MpipeError(f"{where}: {key}.num_layers is {shown(num_layers)}, but it must be an integer; fix the file")
    if num_layers is not None and sum(counts) != num_layers:
        raise MpipeError(f"{where}: {key}.pipeline_num_layers sums to {sum(counts)}, but {key}.num_layers is "
                         f"{num_layers}; MindSpeed-MM's last stage is the one whose layers end at num_layers, so "
                         f"they must agree")


def _recompute(granularity: Any) -> bool | str:
    return {"full": True, "selective": "selective"}.get(granularity, False) if isinstance(granularity, str) else False


# ---- launch arguments ----------------------------------------------------------------------------

_ASSIGNMENT = re.compile(r"^\s*(?:export\s+)?([A-Za-z_]\w*)=(\S+)\s*$", re.MULTILINE)
_VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")
_ARITHMETIC = re.compile(r"^\$\(\((.*)\)\)$")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.floordiv,
              ast.FloorDiv: operator.floordiv}


def _read_args(launch_args: str) -> dict[str, Any]:
    """The fields :data:`FLAGS` set, from the flags or from a launch script's text."""
    path = Path(launch_args)
    is_file = "\n" not in launch_args and not launch_args.lstrip().startswith("-") and path.is_file()
    where = f"launch script {launch_args}" if is_file else f"launch arguments '{launch_args}'"
    if not is_file and not launch_args.lstrip().startswith("-"):
        raise MpipeError(f"{where}: neither a launch script that exists nor Megatron flags; give the script's path "
                         f"or the flags, e.g. '--tensor-model-parallel-size 2 --pipeline-model-parallel-size 4'")
    if is_file and path_problem(path) is not None:
        raise MpipeError(f"{where} is {path_problem(path)}; give the launch script's path")
    text = path.read_text(encoding="utf-8", errors="replace") if is_file else launch_args
    text = _substitute(text)
    tokens = re.findall(r"[^\s\\\"']+", text)
    values: dict[str, Any] = {}
    for i, token in enumerate(tokens):
        if token in FLAGS:
            value = tokens[i + 1] if i + 1 < len(tokens) else ""
            field = FLAGS[token]
            if field == "recompute":
                values[field] = _recompute(value)
                continue
            if not re.fullmatch(r"[0-9]{1,9}", value) or int(value) < 1:
                raise MpipeError(f"{where}: {token} is {shown(value)}, but it must be an integer >= 1 of at most 9 digits "
                                 f"(a shell variable this reader could not resolve? give the flags themselves)")
            values[field] = int(value)
    if not any(token in FLAGS for token in tokens):
        raise MpipeError(f"{where}: none of {', '.join(FLAGS)} is in it; give the script that launches the run "
                         f"(its GPT_ARGS), or those flags in quotes")
    return values


def _substitute(text: str) -> str:
    """``text`` with the simple variables its assignments define substituted, arithmetic ones evaluated."""
    known: dict[str, str] = {}
    for name, value in _ASSIGNMENT.findall(text):
        value = _VARIABLE.sub(lambda m: known.get(m.group(1) or m.group(2), m.group(0)), value.strip("\"'"))
        arithmetic = _ARITHMETIC.match(value)
        if arithmetic:
            number = _evaluate(arithmetic.group(1))
            if number is None:
                continue
            value = str(number)
        known[name] = value
    return _VARIABLE.sub(lambda m: known.get(m.group(1) or m.group(2), m.group(0)), text)


def _evaluate(expression: str) -> int | None:
    """An integer expression of + - * / on integers, or None.

    >>> _evaluate("8*2/2/1"), _evaluate("$X*2"), _evaluate("*".join(["99999999"] * 500))
    (8, None, None)
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        return None
    try:
        tree = ast.parse(expression, mode="eval").body
    except (SyntaxError, RecursionError, MemoryError):
        return None

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and -2**63 <= node.value < 2**63:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            right = walk(node.right)
            if isinstance(node.op, (ast.Div, ast.FloorDiv)) and right == 0:
                raise ValueError("division by zero")
            value = _OPERATORS[type(node.op)](walk(node.left), right)
            if not -2**63 <= value < 2**63:
                raise ValueError("out of range")
            return value
        raise ValueError("not an integer expression")

    try:
        return walk(tree)
    except ValueError:
        return None
