"""`mpipe-tune profile`: a reduced real sweep, the assembled profile, and one-line user errors."""

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from mpipe_tune.cost._profile import COLLECTIVES, LINK_CLASSES, load_profile, parse_profile
from mpipe_tune.profiler import Measurements, assemble_profile
from mpipe_tune.profiler._calibrate import LayerPoint
from mpipe_tune.profiler import fit_alpha_beta, to_link_cost
from mpipe_tune.profiler._links import LinkSweep
from mpipe_tune.profiler._overlap import OverlapPoint, overlap_share
from mpipe_tune.profiler._roofline import RatePoint, RateSweep
from mpipe_tune.profiler import summarize


def run_profile(*args, env=None, timeout=900):  # a hang guard, far above a loaded run
    proc = subprocess.run([sys.executable, "-m", "mpipe_tune.cli", "profile", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)
    return proc.returncode, proc.stdout, proc.stderr


def test_quick_cpu_sweep_writes_a_profile_that_loads(tmp_path):
    out = tmp_path / "quick.json"
    code, stdout, stderr = run_profile("--device", "cpu", "--nproc", "2", "--quick", "--calibrate", "tiny-vit-llm",
                                       "--out", str(out))
    assert code == 0, stderr
    profile = load_profile(out)
    assert profile.name == "quick" and profile.devices_per_node == 2
    assert set(profile.peak_flops_per_s) == {"fp32", "bf16"}
    assert profile.memory_bytes_per_s > 0 and profile.memory_capacity_bytes > 0
    memory = profile.provenance["memory_bytes_per_s"]  # the two ranks' share, copying at once; alone beside it
    assert memory["alone_bytes_per_s"] > 0 and "2 processes at once" in memory["ref"]
    for collective in COLLECTIVES:
        for link_class in LINK_CLASSES:
            assert (link_class, collective) in profile.links
        origin = profile.provenance[f"links.intra_node.{collective}"]
        assert origin["source"] == "measured" and origin["fit_r2"] <= 1
        assert len(origin["sizes_bytes"]) == len(origin["median_s"]) == len(origin["iqr_s"]) >= 6
        # The stored per-step cost is the fit of the stored medians, inverted for the group size.
        line = fit_alpha_beta(origin["sizes_bytes"], origin["median_s"])
        link = to_link_cost(line, collective, origin["group_size"])
        assert replace(profile.link(collective), curve=None) == pytest.approx(link)
        assert profile.link(collective).curve == (collective, origin["group_size"], tuple(origin["sizes_bytes"]),
                                                  tuple(origin["median_s"]))  # the sweep, for large reduces
        inter = profile.provenance[f"links.inter_node.{collective}"]
        assert inter["source"] == "assumed" and "not measured" in inter["ref"]
        assert profile.link(collective, inter_node=True) == replace(profile.link(collective), curve=None)
    assert profile.provenance["peak_flops_per_s.fp32"]["source"] == "measured"
    kinds = {"default", "patch_embed", "vit_block", "merger", "embedding", "dense_block", "lm_head"}
    assert set(profile.efficiency) == kinds
    for kind in kinds:
        origin = profile.provenance[f"efficiency.{kind}"]
        assert origin["source"] == "measured" and 0 < profile.efficiency_for(kind) <= 1
        assert len(origin["median_s"]) == len(origin["predicted_s"]) == len(origin["tokens"]) >= 2
    vit = profile.to_dict()["efficiency"]["vit_block"]
    assert 4 in vit["images"] and 1 in vit["images"]  # the ViT block also on several images per microbatch
    assert profile.image_overhead_for("vit_block") == (vit["forward_image_overhead_s"], vit["backward_image_overhead_s"])
    assert profile.image_overhead_for("dense_block") == (0.0, 0.0)
    for kind in kinds:  # two ranks: the chain also timed split over the pair, for every kind's split overhead
        fwd_s, bwd_s = profile.tp_overhead_for(kind, 2)
        assert fwd_s >= 0 and bwd_s >= 0 and profile.tp_overhead_for(kind, 4) == (0.0, 0.0)
        evidence = profile.provenance[f"efficiency.{kind}"]["tp_calibration"]["2"]
        assert len(evidence["median_s"]) == len(evidence["predicted_s"]) == len(evidence["tokens"]) >= 4
    update = profile.provenance["optimizer_update_bytes_per_s"]
    assert update["source"] == "measured" and update["size_bytes"] > 0
    assert profile.update_bytes_per_s == pytest.approx(update["size_bytes"] / update["median_s"])
    assert update["repeats"] % 2 == 0  # both local ranks timed it at once: their repeats are pooled
    overlap = profile.provenance["comm_compute_overlap"]  # the two ranks' all-gather beside a product
    assert overlap["source"] == "measured" and 0 <= profile.comm_compute_overlap <= 1
    assert profile.comm_compute_overlap == overlap_share(overlap["gemm_s"], overlap["comm_s"], overlap["both_s"])
    fsdp = profile.provenance["fsdp_host_s"]  # FSDP2 timed on real fully_shard-ed layers of 2 and of 16 tensors
    assert fsdp["source"] == "measured" and list(fsdp["linears"]) == [1, 1, 8] and len(fsdp["fsdp_s"]) == 3
    for key in ("fsdp_host_s", "fsdp_bytes_s", "fsdp_collective_s", "fsdp_tensor_s"):
        assert profile.provenance[key]["source"] == "measured" and getattr(profile, key) >= 0
    assert "wrote" in stdout and "p2p" in stdout and "optimizer update" in stdout
    assert "host dispatch" in stdout and "kernel gemm" in stdout and "kernel attention" in stdout
    assert [p.name for p in tmp_path.iterdir()] == ["quick.json"]  # no scratch or temporary files left


def _measurements(quick=False, layer_points=(), overlap=None):
    def sweep(collective, g, alpha, beta):
        sizes = (8, 1024, 2**20)
        return LinkSweep(collective, g, sizes, tuple((alpha + beta * n,) * 3 for n in sizes))

    return Measurements(
        device="cpu", device_name="test cpu", nproc=2, devices_per_node=2, torch_version="0.0",
        peak_flops={"fp32": RateSweep((RatePoint(256, summarize([1e10, 2e10])), RatePoint(512, summarize([3e10]))))},
        memory=RateSweep((RatePoint(2**26, summarize([1e10, 1.2e10, 1.1e10])),)),
        memory_capacity_bytes=8e9, memory_capacity_ref="test",
        links={c: sweep(c, 2, 1e-4, 1e-9) for c in COLLECTIVES}, quick=quick, threads_per_process=1,
        layer_points=layer_points, calibration_model="m" if layer_points else None,
        calibration_dtype="fp32" if layer_points else None, overlap=overlap,
    )


def test_assembled_profile_parses_and_inverts_the_closed_forms():
    data = assemble_profile(_measurements(), name="t", date="2026-01-01")
    profile = parse_profile(json.loads(json.dumps(data)), where="test")
    assert profile.peak("fp32") == 3e10
    assert profile.memory_bytes_per_s == pytest.approx(1.1e10)
    assert profile.link("p2p").alpha_s == pytest.approx(1e-4)
    # all_reduce over 2 ranks: t = 2a + b n, so the per-step cost is (5e-5, 1e-9).
    assert profile.link("all_reduce").alpha_s == pytest.approx(5e-5)
    assert profile.link("all_reduce").beta_s_per_byte == pytest.approx(1e-9)
    assert profile.link("gather").beta_s_per_byte == pytest.approx(2e-9)
    assert profile.provenance["links.intra_node.gather"]["date"] == "2026-01-01"
    assert profile.efficiency == {"default": 1.0}
    assert profile.provenance["efficiency.default"]["source"] == "assumed"
    assert profile.comm_compute_overlap is None and profile.overlap_share == 1.0  # none measured: full overlap


def test_a_measured_overlap_is_written_with_its_medians_and_read_back():
    # a product of 20 ms and an all-gather of 8 ms that took 26 ms together: 2 of the 8 ms hidden
    point = OverlapPoint(gemm_s=0.02, comm_s=0.008, both_s=0.026, matrix_size=768, message_bytes=2**22, repeats=7,
                         group_size=2)
    data = assemble_profile(_measurements(overlap=point), name="t", date="2026-01-01")
    profile = parse_profile(json.loads(json.dumps(data)), where="test")
    assert profile.comm_compute_overlap == pytest.approx(0.25) and profile.overlap_share == pytest.approx(0.25)
    origin = profile.provenance["comm_compute_overlap"]
    assert origin["source"] == "measured" and origin["date"] == "2026-01-01" and origin["both_s"] == 0.026
    assert "768x768" in origin["ref"] and "4.00 MiB all-gather" in origin["ref"]
    assert parse_profile(profile.to_dict(), where="again") == profile
    quick = assemble_profile(_measurements(quick=True), name="t")
    assert "--quick" in quick["notes"] and "smoke test" in quick["links"]["intra_node"]["p2p"]["ref"]


def test_assembled_efficiencies_are_fitted_per_kind_against_the_measured_peak():
    # Peak 3e10 FLOP/s, bandwidth 1.1e10 B/s (from _measurements); compute-bound points.
    def point(kind, flops, eff):
        return LayerPoint(kind, kind, 64, "fwd", flops, 1.0, summarize([flops / (eff * 3e10)]))

    points = (point("vit_block", 1e9, 0.5), point("vit_block", 4e9, 0.5), point("dense_block", 1e9, 0.1))
    profile = parse_profile(assemble_profile(_measurements(layer_points=points), name="t"), where="test")
    assert profile.efficiency_for("vit_block") == pytest.approx(0.5, rel=2e-3)
    assert profile.efficiency_for("dense_block") == pytest.approx(0.1, rel=2e-3)
    assert 0.1 < profile.efficiency["default"] < 0.5
    origin = profile.provenance["efficiency.vit_block"]
    assert origin["source"] == "measured" and origin["rms_relative_error"] < 2e-3 and origin["tokens"] == (64, 64)
    assert origin["flops"] == (1e9, 4e9)  # the work behind each point, to refit from the file
    # Forward points only, two sizes: no backward efficiency of its own and no call overhead.
    assert profile.backward_efficiency_for("vit_block") == profile.efficiency_for("vit_block")
    assert profile.call_overhead_for("vit_block") == (0.0, 0.0)


def test_cpu_ranks_copying_at_once_set_the_bandwidth_and_the_fits_use_it():
    # One process alone copied at 1.1e10 B/s, each of two at once at 0.6e10: the profile's bandwidth is the
    # shared one (a run's ranks stream at once), the alone rate kept beside it, and a memory-bound layer
    # whose calls take bytes / 0.6e10 fits exactly (at the alone rate no fixed seconds per call could).
    def point(size):
        return LayerPoint("embed", "embedding", int(size / 1e4), "fwd", 0.0, size, summarize([size / 0.6e10]))

    together = RatePoint(2**26, summarize([0.58e10, 0.6e10, 0.62e10]))
    points = tuple(point(b) for b in (1e6, 4e6, 1.6e7))
    data = assemble_profile(replace(_measurements(layer_points=points), memory_together=together), name="t")
    profile = parse_profile(json.loads(json.dumps(data)), where="test")
    assert profile.memory_bytes_per_s == pytest.approx(0.6e10)
    origin = profile.provenance["memory_bytes_per_s"]
    assert origin["alone_bytes_per_s"] == pytest.approx(1.1e10) and "2 processes at once" in origin["ref"]
    fit = profile.provenance["efficiency.embedding"]
    assert fit["rms_relative_error"] < 1e-6 and profile.call_overhead_for("embedding")[0] == pytest.approx(0.0, abs=1e-9)
    alone = parse_profile(assemble_profile(_measurements(layer_points=points), name="t"), where="alone")
    assert alone.memory_bytes_per_s == pytest.approx(1.1e10)
    assert alone.provenance["efficiency.embedding"]["rms_relative_error"] > 0.05


def test_assembled_profile_fits_each_phase_with_its_call_overhead():
    # dense_block: forward at efficiency 0.4 plus 1 ms per call, backward at 0.6 plus 2 ms, four sizes.
    def point(phase, flops, eff, overhead_s):
        return LayerPoint("decoder.0", "dense_block", int(flops / 1e7), phase, flops, 1.0,
                          summarize([overhead_s + flops / (eff * 3e10)]))

    sizes = (1e8, 3e8, 1e9, 3e9)
    points = tuple(point("fwd", w, 0.4, 1e-3) for w in sizes) + tuple(point("bwd", 2 * w, 0.6, 2e-3) for w in sizes)
    data = assemble_profile(_measurements(layer_points=points), name="t")
    profile = parse_profile(data, where="test")
    assert profile.efficiency_for("dense_block") == pytest.approx(0.4, rel=2e-3)
    assert profile.backward_efficiency_for("dense_block") == pytest.approx(0.6, rel=2e-3)
    assert profile.call_overhead_for("dense_block") == pytest.approx((1e-3, 2e-3), rel=1e-2)
    origin = profile.provenance["efficiency.dense_block"]
    assert origin["rms_relative_error"] < 2e-3
    assert origin["predicted_s"] == pytest.approx(origin["median_s"], rel=2e-3)  # aligned with the points


HAS_CUDA = importlib.util.find_spec("torch") is not None and __import__("torch").cuda.is_available()
HAS_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None


@pytest.mark.parametrize("args,words", [
    (["--device", "tpu"], "'tpu' is not a device"),
    (["--device", "cpu", "--nproc", "1"], "at least 2 processes"),
    (["--device", "cpu", "--nproc", "500"], "--nproc is 500, above 64"),
    (["--device", "cpu", "--dtypes", "fp32,fp7"], "'fp7' is not a dtype"),
    (["--device", "cpu", "--dtypes", "fp8"], "no plain torch.matmul"),
    (["--device", "cpu", "--dtypes", "tf32"], "CUDA matmul mode"),
    (["--device", "cpu", "--dtypes", ","], "--dtypes is empty"),
    (["--device", "cpu", "--calibrate", "nope"], "nope"),
    # profile's --compute is not run's compute mode: the line offers another calibration model, not an emulated run
    (["--device", "cpu", "--calibrate", "example-mllm"], "no runtime layer to time; give as calibration model "
                                                          "(--calibrate) one whose layers give an architecture kind"),
    pytest.param(["--device", "cuda"], "no CUDA device is visible",
                 marks=pytest.mark.skipif(HAS_CUDA, reason="this host has a CUDA GPU")),
    pytest.param(["--device", "npu"], "needs torch_npu",
                 marks=pytest.mark.skipif(HAS_TORCH_NPU, reason="torch_npu is installed")),
])
def test_bad_request_is_one_line_exit_2_and_writes_nothing(tmp_path, args, words):
    out = tmp_path / "p.json"
    code, stdout, stderr = run_profile(*args, "--out", str(out), timeout=300)
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in stderr, stderr
    assert words in lines[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("out,words", [
    ("missing-dir/p.json", "does not exist"),
    ("p.yaml", "must end in .json"),
    ("adir.json", "is a folder"),
    ("/sys/p.json", "cannot write in"),
])
def test_bad_out_path_is_one_line_exit_2_and_writes_nothing(tmp_path, out, words):
    (tmp_path / "adir.json").mkdir()
    path = out if out.startswith("/") else str(tmp_path / out)
    code, _, stderr = run_profile("--device", "cpu", "--quick", "--out", path, timeout=300)
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert words in stderr
    assert [p.name for p in tmp_path.iterdir()] == ["adir.json"]


def test_without_torch_the_planner_imports_and_profile_says_what_to_install(tmp_path):
    script = ("import sys; sys.modules['torch'] = None\n"
              "import mpipe_tune.cli as cli\n"
              "assert 'profile' in [c.name for c in cli.COMMANDS]\n"
              f"sys.exit(cli.main(['profile', '--device', 'cpu', '--quick', '--out', {str(tmp_path / 'p.json')!r}]))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "needs torch" in proc.stderr and "mpipe-tune[torch]" in proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("preset,expected", [(None, "0"), ("1", "1")])
def test_backend_autoload_is_switched_off_for_cpu_unless_the_user_set_it(preset, expected):
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    if preset is not None:
        env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = preset
    script = ("import os\nfrom mpipe_tune.profiler._device import import_torch\nimport_torch('cpu')\n"
              "print(os.environ['TORCH_DEVICE_BACKEND_AUTOLOAD'])\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == expected
