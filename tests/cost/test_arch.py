"""Architecture-based layer costs, checked against closed forms and published model sizes.

The closed forms here are written from first principles (matmul FLOPs are ``2 * params * tokens``,
training is three times the forward, attention is ``4 * s^2 * h`` per layer), not from the code
paths of ``mpipe_tune.cost._arch``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from mpipe_tune.cost._arch import (
    ARCH_KINDS, OPTIONAL_DIMS, ArchWork, activated_param_count, estimate_arch_work, param_count, validate_arch,
)
from mpipe_tune.inputs import Microbatch
from mpipe_tune.errors import MpipeError

MODELS_DIR = Path(__file__).resolve().parents[2] / "models"
STRUCTURAL_KEYS = ("name", "block", "kind", "repeat", "trainable")
IMAGE_STREAM_KINDS = ("patch_embed", "vit_block", "merger", "projector", "pixel_shuffle")
WEIGHTLESS_KINDS = ("pixel_shuffle",)
BUILT_INS = (
    "llama3-8b",
    "llama3-70b",
    "qwen2-vl-7b-llm",
    "qwen2-vl-vit",
    "siglip-so400m",
    "deepseek-v3",
    "qwen2vl-vit-llama3-8b",
    "qwen2vl-vit-qwen2-7b",
    "qwen2vl-vit-deepseek-v3",
    "siglip-llama3-70b",
    "tiny-vit-llm",
)


def load_layers(name: str) -> list[tuple[str, dict, int, str]]:
    """(kind, dims, repeat, block) of each layer entry of built-in model ``name``, compose expanded."""
    data = yaml.safe_load((MODELS_DIR / f"{name}.yaml").read_text())
    if "compose" in data:
        layers = []
        for entry in data["compose"]:
            if isinstance(entry, str):
                layers.extend(load_layers(entry))
            else:
                layers.extend(_entries(entry["layers"]))
        return layers
    return _entries(data["layers"])


def _entries(entries: list[dict]) -> list[tuple[str, dict, int, str]]:
    return [
        (e["kind"], {k: v for k, v in e.items() if k not in STRUCTURAL_KEYS}, e.get("repeat", 1), e["block"])
        for e in entries
    ]


def model_params(name: str, count=param_count) -> int:
    return sum(repeat * count(kind, dims) for kind, dims, repeat, _ in load_layers(name))


def training_flops(work: ArchWork) -> float:
    return work.fwd_flops + work.dgrad_flops + work.wgrad_flops


def model_training_flops(name: str, mb: Microbatch) -> float:
    return sum(
        repeat * training_flops(estimate_arch_work(kind, dims, mb, dtype_bytes=2))
        for kind, dims, repeat, _ in load_layers(name)
    )


def text(tokens: int) -> Microbatch:
    return Microbatch(image_tokens=0, text_tokens=tokens)


# --- built-in model files ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", BUILT_INS)
def test_built_in_models_pass_validation_and_cite_a_source(name):
    data = yaml.safe_load((MODELS_DIR / f"{name}.yaml").read_text())
    assert data["name"] == name
    assert data["source"].strip()
    for index, (kind, dims, _, block) in enumerate(load_layers(name)):
        validate_arch(kind, dims, where=f"{name} layer {index}")
        assert (block == "encoder") == (kind in ("patch_embed", "vit_block", "merger"))


@pytest.mark.parametrize("name", ["qwen2vl-vit-llama3-8b", "qwen2vl-vit-deepseek-v3", "siglip-llama3-70b"])
def test_pairings_project_encoder_width_to_backbone_width(name):
    layers = load_layers(name)
    encoder_out = [d.get("out_hidden", d["hidden"]) for k, d, _, b in layers if b == "encoder"][-1]
    (projector,) = [d for k, d, _, b in layers if k == "projector"]
    backbone = [d["hidden"] for k, d, _, b in layers if b == "llm"][0]
    assert (projector["in_hidden"], projector["hidden"]) == (encoder_out, backbone)


# --- parameter counts against published sizes -------------------------------------------------------

PUBLISHED_PARAMS = {
    "llama3-8b": 8.03e9,
    "llama3-70b": 70.6e9,
    "qwen2-vl-7b-llm": 7.62e9,  # Qwen2-VL-7B's 8.29B less its 675M ViT
    "qwen2vl-vit-qwen2-7b": 8.29e9,
    "qwen2-vl-vit": 675e6,
    "deepseek-v3": 671e9,
    # The full So400m vision tower has 428M parameters, of which 15.2M are its attention-pooling
    # head (probe, attention, LayerNorm, MLP); MLLMs drop the head and so does siglip-so400m.yaml.
    "siglip-so400m": 428e6 - 15.2e6,
}


@pytest.mark.parametrize("name, published", PUBLISHED_PARAMS.items())
def test_param_count_matches_published_size(name, published):
    assert model_params(name) == pytest.approx(published, rel=0.02)


def test_deepseek_v3_activated_params_match_published_37b():
    assert model_params("deepseek-v3", activated_param_count) == pytest.approx(37e9, rel=0.05)


def test_activated_params_equal_params_for_dense_kinds():
    for kind, dims, _, _ in load_layers("qwen2vl-vit-llama3-8b"):
        assert activated_param_count(kind, dims) == param_count(kind, dims)


def test_llama3_8b_block_params_exact():
    h, kv_width, ffn = 4096, 8 * 128, 14336
    expected = 2 * h * h + 2 * h * kv_width + 3 * h * ffn + 2 * h  # q, o; k, v; SwiGLU; two RMSNorm gains
    assert param_count("dense_block", {"hidden": h, "heads": 32, "kv_heads": 8, "ffn": ffn}) == expected


# --- training FLOPs against Megatron-LM's formula ---------------------------------------------------


def megatron_gqa_swiglu_training_flops(dims: dict, layers: int, vocab: int, seq: int) -> float:
    """Narayanan et al. (2021) counted from first principles, for GQA attention and a SwiGLU MLP.

    Training = 3 x forward (input and weight gradients each cost the forward again). Forward of one
    block: ``2 * s * P`` for its matmuls with ``P`` weights, plus ``4 * s^2 * h`` for the attention
    scores and values (full square, also for causal attention). The head adds ``2 * s * h * V``.
    With ``P = 12 h^2`` (MHA, 4h GeLU MLP) this is Megatron's ``72 s l h^2 (1 + s/6h + V/12lh)``.
    """
    h, heads, kv_heads, ffn = dims["hidden"], dims["heads"], dims["kv_heads"], dims["ffn"]
    head_dim = h // heads
    matmul_weights = h * heads * head_dim * 2 + 2 * h * kv_heads * head_dim + 3 * h * ffn
    block = 2 * seq * matmul_weights + 4 * seq**2 * heads * head_dim
    return 3 * (layers * block + 2 * seq * h * vocab)


@pytest.mark.parametrize("name", ["llama3-8b", "llama3-70b", "qwen2-vl-7b-llm"])
@pytest.mark.parametrize("seq", [2048, 8192])
def test_dense_model_training_flops_match_megatron_formula(name, seq):
    layers = load_layers(name)
    ((dims, num_blocks),) = [(d, r) for k, d, r, _ in layers if k == "dense_block"]
    (vocab,) = [d["vocab"] for k, d, _, _ in layers if k == "lm_head"]
    expected = megatron_gqa_swiglu_training_flops(dims, num_blocks, vocab, seq)
    assert model_training_flops(name, text(seq)) == pytest.approx(expected, rel=0.02)


def test_mha_gelu_block_matches_megatron_closed_form():
    h, seq, layers = 1024, 2048, 1
    dims = {"hidden": h, "heads": 16, "ffn": 4 * h, "activation": "gelu"}
    work = estimate_arch_work("dense_block", dims, text(seq), dtype_bytes=2)
    assert training_flops(work) == pytest.approx(72 * seq * layers * h**2 * (1 + seq / (6 * h)), rel=0.01)


def test_weight_gradient_flops_are_two_per_matmul_weight_per_token():
    dims = {"hidden": 256, "heads": 8, "kv_heads": 2, "ffn": 704}
    matmul_weights = 2 * 256 * 256 + 2 * 256 * 64 + 3 * 256 * 704
    work = estimate_arch_work("dense_block", dims, text(100), dtype_bytes=2)
    assert work.wgrad_flops == 2 * 100 * matmul_weights


def test_moe_flops_count_only_activated_experts():
    """Per token, a DeepSeek-V3 MoE layer trains at about 6 x its activated parameters (short sequence)."""
    (dims,) = [d for k, d, _, _ in load_layers("deepseek-v3") if k == "moe_block"]
    seq = 64
    work = estimate_arch_work("moe_block", dims, text(seq), dtype_bytes=2)
    qk_dim, v_dim = dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"], dims["v_head_dim"]
    attention_core = 3 * 2 * seq**2 * dims["heads"] * (qk_dim + v_dim)
    expected = 6 * seq * activated_param_count("moe_block", dims) + attention_core
    assert training_flops(work) == pytest.approx(expected, rel=0.02)
    assert param_count("moe_block", dims) > 15 * activated_param_count("moe_block", dims)


# --- the image stream -------------------------------------------------------------------------------

VIT_DIMS = {"hidden": 1280, "heads": 16, "ffn": 5120, "merge_factor": 4}


def test_vit_attention_is_quadratic_per_image():
    n = 256
    one_big = estimate_arch_work("vit_block", VIT_DIMS, Microbatch(2 * n, 0, images=(2 * n,)), dtype_bytes=2)
    two_small = estimate_arch_work("vit_block", VIT_DIMS, Microbatch(2 * n, 0, images=(n, n)), dtype_bytes=2)
    assert one_big.fwd_flops > two_small.fwd_flops
    assert one_big.dgrad_flops > two_small.dgrad_flops
    assert one_big.wgrad_flops == two_small.wgrad_flops  # matmuls are linear in tokens
    # Scores and values: 4 * patches^2 * hidden per image; (2P)^2 - 2 P^2 = 2 P^2 with P = n * merge.
    patches = n * VIT_DIMS["merge_factor"]
    assert one_big.fwd_flops - two_small.fwd_flops == pytest.approx(4 * 2 * patches**2 * 1280, rel=1e-9)


def test_image_stream_counts_merged_patches():
    merged = estimate_arch_work("vit_block", VIT_DIMS, Microbatch(100, 0), dtype_bytes=2)
    unmerged = estimate_arch_work("vit_block", {**VIT_DIMS, "merge_factor": 1}, Microbatch(400, 0), dtype_bytes=2)
    assert merged == unmerged
    assert merged.boundary_bytes == 400 * 1280 * 2


@pytest.mark.parametrize("kind, dims", [(k, d) for k, d, _, _ in load_layers("qwen2vl-vit-llama3-8b")])
def test_a_stream_without_tokens_does_no_work(kind, dims):
    image_only, text_only = Microbatch(64, 0), Microbatch(0, 64)
    idle = text_only if kind in IMAGE_STREAM_KINDS else image_only
    busy = image_only if kind in IMAGE_STREAM_KINDS else text_only
    assert estimate_arch_work(kind, dims, idle, dtype_bytes=2) == ArchWork(*[0.0] * 9)
    work = estimate_arch_work(kind, dims, busy, dtype_bytes=2)
    assert work.fwd_bytes > 0 and work.saved_activation_bytes >= 0


def test_embedding_does_no_forward_flops_and_head_writes_logits():
    mb = text(512)
    embed = estimate_arch_work("embedding", {"vocab": 128256, "hidden": 4096}, mb, dtype_bytes=2)
    assert embed.fwd_flops == 0 and embed.wgrad_flops > 0 and embed.boundary_bytes == 512 * 4096 * 2
    head = estimate_arch_work("lm_head", {"vocab": 128256, "hidden": 4096}, mb, dtype_bytes=2)
    logits_bytes = 512 * 128256 * 2
    assert head.fwd_bytes > 2 * logits_bytes  # written by the matmul, read by the loss
    assert head.saved_activation_bytes > logits_bytes and head.boundary_bytes == 0


# --- bytes and activations --------------------------------------------------------------------------


def test_saved_activations_of_a_dense_block():
    """Kept for the backward: block input, both norm outputs, q, k, v, attention output, the residual
    stream before the MLP norm, and the SwiGLU gate, up and product."""
    h, kv_width, ffn, seq = 4096, 1024, 14336, 1000
    dims = {"hidden": h, "heads": 32, "kv_heads": 8, "ffn": ffn}
    work = estimate_arch_work("dense_block", dims, text(seq), dtype_bytes=2)
    elems = seq * (6 * h + 2 * kv_width + 3 * ffn)
    assert work.saved_activation_bytes == 2 * elems


def test_bytes_scale_with_dtype_and_flops_do_not():
    dims = {"hidden": 512, "heads": 8, "ffn": 1536, "rope_dim": 0}  # RoPE's angles are fp32 whatever the dtype
    # (tests/cost/test_rope.py)
    half = estimate_arch_work("dense_block", dims, text(300), dtype_bytes=2)
    full = estimate_arch_work("dense_block", dims, text(300), dtype_bytes=4)
    assert full.fwd_flops == half.fwd_flops
    for field in ("fwd_bytes", "dgrad_bytes", "wgrad_bytes", "saved_activation_bytes", "boundary_bytes"):
        assert getattr(full, field) == pytest.approx(2 * getattr(half, field))


def test_forward_reads_every_weight_once():
    dims = {"hidden": 1024, "heads": 16, "ffn": 2816}
    small, large = (estimate_arch_work("dense_block", dims, text(n), dtype_bytes=2) for n in (1, 2))
    per_token_bytes = large.fwd_bytes - small.fwd_bytes
    assert small.fwd_bytes - per_token_bytes == pytest.approx(2 * param_count("dense_block", dims), rel=1e-3)


# --- tensor parallelism -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind, dims, mb", [
    ("dense_block", {"hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336}, text(4096)),
    ("vit_block", VIT_DIMS, Microbatch(1024, 0, images=(256, 768))),
    ("lm_head", {"hidden": 4096, "vocab": 128256}, text(4096)),
])
def test_tensor_parallel_halves_flops_and_adds_all_reduces(kind, dims, mb):
    one = estimate_arch_work(kind, dims, mb, dtype_bytes=2)
    two = estimate_arch_work(kind, dims, mb, dtype_bytes=2, tp_degree=2)
    assert two.fwd_flops == pytest.approx(one.fwd_flops / 2, rel=0.01)
    assert two.dgrad_flops + two.wgrad_flops == pytest.approx((one.dgrad_flops + one.wgrad_flops) / 2, rel=0.01)
    assert one.tp_comm_bytes == 0 and two.tp_comm_bytes > 0
    assert two.boundary_bytes == one.boundary_bytes


def test_transformer_block_all_reduces_twice_per_forward():
    dims = {"hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336}
    work = estimate_arch_work("dense_block", dims, text(2048), dtype_bytes=2, tp_degree=4)
    assert work.tp_comm_bytes == 2 * 2048 * 4096 * 2


def test_kv_heads_are_replicated_when_fewer_than_ranks():
    dims = {"hidden": 1024, "heads": 16, "kv_heads": 2, "ffn": 2048}
    four = estimate_arch_work("dense_block", dims, text(256), dtype_bytes=2, tp_degree=4)
    two = estimate_arch_work("dense_block", dims, text(256), dtype_bytes=2, tp_degree=2)
    assert four.fwd_flops > two.fwd_flops / 2  # k and v projections do not shrink past one head per rank


# --- validation -------------------------------------------------------------------------------------

LLAMA = {"hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336}
MOE = {"hidden": 1024, "heads": 8, "experts": 8, "top_k": 2, "moe_ffn": 512}


@pytest.mark.parametrize("kind, dims, field", [
    ("dense_blok", LLAMA, "dense_blok"),
    ("dense_block", {k: v for k, v in LLAMA.items() if k != "ffn"}, "ffn"),
    ("dense_block", {**LLAMA, "hidden": -4096}, "hidden"),
    ("dense_block", {**LLAMA, "heads": 0}, "heads"),
    ("dense_block", {**LLAMA, "ffn": 14336.5}, "ffn"),
    ("dense_block", {**LLAMA, "ffn": True}, "ffn"),
    ("dense_block", {**LLAMA, "kv_heads": 5}, "kv_heads"),
    ("dense_block", {**LLAMA, "hiden": 4096}, "hiden"),
    ("dense_block", {**LLAMA, "activation": "relu"}, "activation"),
    ("dense_block", {**LLAMA, "kv_lora_rank": 512}, "kv_lora_rank"),
    ("dense_block", {**LLAMA, "attention": "mla"}, "kv_heads"),
    ("dense_block", {"hidden": 4096, "heads": 32, "ffn": 1, "attention": "mla"}, "kv_lora_rank"),
    ("dense_block", {"hidden": 100, "heads": 3, "ffn": 128}, "heads"),
    ("moe_block", {**MOE, "top_k": 9}, "top_k"),
    ("moe_block", {**MOE, "shared_experts": -1}, "shared_experts"),
    ("vit_block", {"hidden": 64, "heads": 4, "ffn": 256}, "merge_factor"),
    ("projector", {"in_hidden": 64, "hidden": 64, "depth": 3}, "depth"),
    ("patch_embed", {"hidden": 64, "patch_size": 14, "merge_factor": 1, "bias": "yes"}, "bias"),
])
def test_validate_arch_names_the_field_in_one_line(kind, dims, field):
    where = "layer 'decoder' of models/x.yaml"
    with pytest.raises(MpipeError) as raised:
        validate_arch(kind, dims, where=where)
    message = str(raised.value)
    assert message.startswith(where) and repr(field) in message and "\n" not in message


def test_validate_arch_lists_known_kinds():
    with pytest.raises(MpipeError, match="dense_block.*vit_block"):
        validate_arch("transformer", {}, where="x")


def test_validate_arch_accepts_every_kind_with_its_required_fields():
    for kind, required in ARCH_KINDS.items():
        dims = {field: 4 for field in required}
        validate_arch(kind, dims, where=kind)
        assert (param_count(kind, dims) > 0) != (kind in WEIGHTLESS_KINDS)
        assert set(OPTIONAL_DIMS[kind]).isdisjoint(required)


# --- properties -------------------------------------------------------------------------------------

decoder_dims = st.builds(
    lambda kv_heads, group, head_dim, ffn, act: {
        "hidden": kv_heads * group * head_dim, "heads": kv_heads * group, "kv_heads": kv_heads,
        "ffn": ffn, "activation": act,
    },
    st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4]), st.sampled_from([8, 16, 64]),
    st.integers(1, 4096), st.sampled_from(["swiglu", "gelu"]),
)


@settings(max_examples=60, deadline=None)
@given(dims=decoder_dims, tokens=st.integers(1, 4096), more=st.integers(1, 512), tp=st.sampled_from([1, 2, 4]))
def test_decoder_work_is_finite_nonnegative_and_grows_with_tokens(dims, tokens, more, tp):
    validate_arch("dense_block", dims, where="property")
    work = estimate_arch_work("dense_block", dims, text(tokens), dtype_bytes=2, tp_degree=tp)
    bigger = estimate_arch_work("dense_block", dims, text(tokens + more), dtype_bytes=2, tp_degree=tp)
    for field in ArchWork.__dataclass_fields__:
        value = getattr(work, field)
        assert math.isfinite(value) and value >= 0
        if field.startswith("memory_bound_wgrad"):  # norm gains' gradients come with the input gradient
            assert value == getattr(bigger, field) == 0.0
        elif field != "tp_comm_bytes" or tp > 1:
            assert getattr(bigger, field) > value


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 2048), min_size=1, max_size=6))
def test_vit_work_depends_on_image_sizes_only_through_attention(sizes):
    total = sum(sizes)
    split = estimate_arch_work("vit_block", VIT_DIMS, Microbatch(total, 0, images=tuple(sizes)), dtype_bytes=2)
    whole = estimate_arch_work("vit_block", VIT_DIMS, Microbatch(total, 0), dtype_bytes=2)
    assert split.wgrad_flops == whole.wgrad_flops
    assert split.fwd_flops <= whole.fwd_flops
