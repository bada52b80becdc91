"""``mpipe-tune profile``: measure this host's roofline and links and write a hardware profile."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from mpipe_tune.cli._command import Command
from mpipe_tune.errors import MpipeError

_DEVICES = ("cpu", "cuda", "npu")


class Profile(Command):
    """The ``profile`` subcommand."""

    name = "profile"
    help = "measure peak FLOP/s, memory bandwidth and alpha-beta links of this host into a profile JSON"
    after_interrupt = "no profile written (it needs every measurement); rerun the command to measure again"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--device", required=True, help="device to measure: cpu, cuda or npu")
        parser.add_argument("--nproc", type=int, default=2,
                            help="processes (one device each) for the link measurement, >= 2 (default 2)")
        parser.add_argument("--dtypes", default="fp32,bf16",
                            help="comma-separated dtypes whose peak FLOP/s to measure (default fp32,bf16)")
        parser.add_argument("--quick", action="store_true",
                            help="a reduced sweep (small sizes, few repeats): a smoke test in seconds")
        parser.add_argument("--calibrate", default=None, metavar="MODEL",
                            help="also fit per-layer-kind efficiencies and call overheads by timing the runtime's "
                                 "layers of this model (built-in name or YAML file) in the first of --dtypes, on "
                                 "--nproc ranks at once as a run's stages, and the runtime's optimizer update")
        parser.add_argument("--compute", default=None, metavar="PROFILE",
                            help="across nodes (the command run by torchrun on every node): the single-node profile "
                                 "(built-in name or JSON file) whose compute figures the measured intra- and "
                                 "inter-node links are merged into")
        parser.add_argument("--out", required=True,
                            help="profile file to write, e.g. my-host.json (plan, predict and run read it with "
                                 "--profile my-host.json)")
        parser.add_argument("--name", default=None, help="profile name (default: the --out file's stem)")

    def take_action(self, args: argparse.Namespace) -> int:
        from mpipe_tune.runtime import is_under_torchrun

        if is_under_torchrun():
            return profile_across_nodes(args)
        if args.compute is not None:
            raise MpipeError(f"--compute {args.compute}: merging links measured across nodes needs the command run "
                             f"by torchrun on every node (torchrun --nnodes N --nproc-per-node K -m mpipe_tune.cli "
                             f"profile ...); on one host leave --compute out")
        device, dtypes, out, name, calibration = validate_request(args)
        from mpipe_tune.runtime import shared_cores_note, usable_cores

        cores = usable_cores()
        note = shared_cores_note(device, args.nproc, "its figures describe ranks that share cores, not this host's "
                                 + (f"devices; give --nproc {cores} or fewer" if cores >= 2 else
                                    "devices (one core: no two ranks here get a core each)"))
        if note:
            print(f"mpipe-tune profile: note: {note}", file=sys.stderr)
        from tqdm import tqdm

        from mpipe_tune.cost import dump_profile, load_profile
        from mpipe_tune.interrupt import phase
        from mpipe_tune.profiler import (
            assemble_profile, count_steps, profile_device, sweep_settings, kernel_sweep_settings, shares_memory,
        )

        begin = time.monotonic()
        kernels = kernel_sweep_settings(device, quick=args.quick)
        total = count_steps(dtypes, sweep_settings(device, quick=args.quick), calibration, kernel_settings=kernels,
                            together=shares_memory(device, args.nproc))
        with tqdm(total=total, desc=f"profile {device}", unit="pt", file=sys.stderr, disable=None,
                  dynamic_ncols=True) as bar:
            def progress(label: str) -> None:
                bar.set_postfix_str(label, refresh=False)
                bar.update()
                phase("measure")  # a safe point: a first Ctrl-C during the roofline stops here

            measurements = profile_device(device, args.nproc, dtypes, quick=args.quick, progress=progress,
                                          calibration=calibration, kernel_settings=kernels)
        dump_profile(assemble_profile(measurements, name=name), out)
        print_summary(load_profile(out), out, time.monotonic() - begin)
        return 0


def profile_across_nodes(args: argparse.Namespace) -> int:
    """Every process torchrun started measures its link classes; rank 0 merges them into the
    ``--compute`` profile, writes it and prints it."""
    from tqdm import tqdm

    from mpipe_tune.cost import dump_profile, load_profile
    from mpipe_tune.interrupt import at_once, phase
    from mpipe_tune.profiler import merge_link_classes, import_torch, LINK_COLLECTIVES, measure_link_classes
    from mpipe_tune.runtime import place_from_env
    from mpipe_tune.profiler import sweep_settings
    from mpipe_tune.outputs import validate_out_path

    place = place_from_env()
    if args.device not in _DEVICES:
        raise MpipeError(f"--device {args.device!r} is not a device the profiler knows; use one of {', '.join(_DEVICES)}")
    if args.calibrate is not None:
        raise MpipeError("--calibrate times the layers on one node: run it there without torchrun, then give that "
                         "profile as --compute here")
    if args.compute is None:
        raise MpipeError("across nodes, profile measures the links only: give --compute PROFILE, a single-node "
                         "profile of this device (mpipe-tune profile --device ... --out one-node.json)")
    compute = out = None
    if place.rank == 0:  # the one that writes: its arguments are checked before anything is measured
        out = validate_out_path(args.out, label="--out", suffixes=(".json",))
        compute = load_profile(args.compute).to_dict()
    begin = time.monotonic()
    settings = sweep_settings(args.device, quick=args.quick)
    with tqdm(total=2 * len(LINK_COLLECTIVES) * settings.link_repeats, desc=f"profile links {args.device}",
              unit="pt", file=sys.stderr, disable=None if place.rank == 0 else True, dynamic_ncols=True) as bar:
        def progress(label: str) -> None:
            bar.set_postfix_str(label, refresh=False)
            bar.update()

        phase("links")
        with at_once():  # every rank gets a terminal's Ctrl-C, and one rank cannot stop alone at a later point
            layout, sweeps = measure_link_classes(args.device, place, settings, progress)
    if place.rank != 0:
        return 0
    name = args.name if args.name is not None else out.stem
    profile = merge_link_classes(compute, sweeps, layout, device=args.device, name=name, quick=args.quick,
                                 torch_version=import_torch(args.device).__version__)
    dump_profile(profile, out)
    print_summary(load_profile(out), out, time.monotonic() - begin)
    return 0


def validate_request(args: argparse.Namespace):
    """Check every argument before anything is measured; returns (device, dtypes, out, name, calibration
    model or None)."""
    from mpipe_tune.cost import DTYPES
    from mpipe_tune.profiler import TORCH_DTYPES, MAX_PROCESSES
    from mpipe_tune.outputs import validate_out_path

    device = args.device
    if device not in _DEVICES:
        raise MpipeError(f"--device {device!r} is not a device the profiler knows; use one of {', '.join(_DEVICES)}")
    if args.nproc < 2:
        raise MpipeError(f"--nproc is {args.nproc}, but the alpha-beta sweep needs at least 2 processes "
                         "(one link has two ends); give --nproc 2 or more")
    if args.nproc > MAX_PROCESSES:
        raise MpipeError(f"--nproc is {args.nproc}, above {MAX_PROCESSES}: the sweep starts one process per device of "
                         f"this host, and no host holds more than {MAX_PROCESSES}; give --nproc 2 to {MAX_PROCESSES} "
                         f"(the number of devices to link)")
    dtypes = tuple(dict.fromkeys(d.strip() for d in args.dtypes.split(",") if d.strip()))
    if not dtypes:
        raise MpipeError("--dtypes is empty; give at least one dtype, e.g. --dtypes fp32,bf16")
    for dtype in dtypes:
        if dtype not in DTYPES:
            raise MpipeError(f"--dtypes: {dtype!r} is not a dtype; use some of {', '.join(TORCH_DTYPES)}")
        if dtype not in TORCH_DTYPES:
            raise MpipeError(f"--dtypes: {dtype!r} has no plain torch.matmul to measure it with; measure it "
                             f"elsewhere and add it to the profile by hand, or use some of {', '.join(TORCH_DTYPES)}")
        if dtype == "tf32" and device != "cuda":
            raise MpipeError(f"--dtypes: 'tf32' is a CUDA matmul mode, not available with --device {device}; "
                             "measure fp32 instead")
    out = validate_out_path(args.out, label="--out", suffixes=(".json",))  # .json: so that --profile reads it as a file
    name = args.name if args.name is not None else out.stem
    if not name.strip():
        raise MpipeError("--name is empty; give the profile a name or leave --name out")
    calibration = None
    if args.calibrate is not None:
        from mpipe_tune.profiler import calibration_layers
        from mpipe_tune.inputs import load_model

        calibration = load_model(args.calibrate)
        calibration_layers(calibration)  # a model the runtime cannot build fails here, in one line
    return device, dtypes, out, name, calibration


def print_curves(profile) -> None:
    """The kernel-efficiency curves of ``profile`` with their fit quality, one line a family."""
    from dataclasses import asdict

    for family, curve in asdict(profile.kernel_efficiency).items() if profile.kernel_efficiency else ():
        if curve is None:
            continue
        origin = profile.provenance[f"kernel_efficiency.{family}"]
        numbers = ", ".join(f"{k} {v:.4g}" for k, v in curve.items() if v is not None)  # optional fields unset
        fit = (f" (R^2 log t {origin['fit_r2']:.4f}, log eff {origin['fit_r2_efficiency']:.3f}, rms "
               f"{origin['rms_relative_error']:.0%}, {len(origin['median_s'])} points)" if "fit_r2" in origin else "")
        print(f"  kernel {family:9s} {numbers}{fit}")


def print_summary(profile, out: Path, elapsed_s: float) -> None:
    """A readable table of the profile just written."""
    print(f"wrote {out} (profile {profile.name!r}) in {elapsed_s:.0f} s")
    print(f"  device  {profile.device}")
    for dtype, value in profile.peak_flops_per_s.items():
        print(f"  peak {dtype:5s} {value / 1e12:9.4g} TFLOP/s")
    print(f"  memory     {profile.memory_bytes_per_s / 1e9:9.4g} GB/s, "
          f"capacity {profile.memory_capacity_bytes / 2**30:.4g} GiB")
    if profile.optimizer_update_bytes_per_s is not None:
        print(f"  optimizer update {profile.optimizer_update_bytes_per_s / 1e9:9.4g} GB/s (the runtime's update, "
              f"timed by every rank at once)")
    if profile.host is not None:
        print(f"  host dispatch {profile.host.dispatch_s * 1e6:.3g} us per operator, sync {profile.host.sync_s * 1e6:.3g} us "
              f"(R^2 log t {profile.provenance['host.dispatch_s'].get('fit_r2', float('nan')):.4f})")
    print_curves(profile)
    for kind, value in profile.efficiency.items():
        origin = profile.provenance[f"efficiency.{kind}"]
        fit = f"  (rms relative error {origin['rms_relative_error']:.0%})" if "rms_relative_error" in origin else ""
        split = ""
        for what, given, ((fwd_s, bwd_s), (fwd_x, bwd_x)) in (
                ("split at tp 2", (kind, 2) in profile.tp_overhead_s or (kind, 2) in profile.tp_slowdown,
                 (profile.tp_overhead_for(kind, 2), profile.tp_slowdown_for(kind, 2))),
                ("experts at ep 2", (kind, 2) in profile.ep_overhead_s or (kind, 2) in profile.ep_slowdown,
                 profile.ep_overhead_for(kind, 2))):
            if given:
                split += (f"  {what}: +{fwd_x:.0%} +{fwd_s * 1e3:.3g} ms / +{bwd_x:.0%} +{bwd_s * 1e3:.3g} ms "
                          f"per forward / backward")
        print(f"  efficiency {kind:14s} {value:8.4g}{fit}{split}")
    for shown_class in ("intra_node", "inter_node"):
        sources = {profile.provenance[f"links.{c}.{k}"].get("source") for c, k in profile.links if c == shown_class}
        if shown_class == "inter_node" and sources == {"assumed"}:
            print("  link (inter_node): not measured, a copy of intra_node (profile across nodes under torchrun)")
            continue
        print(f"  {'link (' + shown_class + ')':18s} {'alpha':>10s} {'bandwidth':>12s} {'R^2 log t':>10s} "
              f"{'group':>6s}  source")
        for (link_class, collective), cost in profile.links.items():
            if link_class != shown_class:
                continue
            origin = profile.provenance[f"links.{link_class}.{collective}"]
            bandwidth = f"{1e-9 / cost.beta_s_per_byte:.4g} GB/s" if cost.beta_s_per_byte else "inf"
            print(f"  {collective:18s} {cost.alpha_s * 1e6:7.3g} us {bandwidth:>12s} "
                  f"{origin.get('fit_r2', float('nan')):10.4f} {origin.get('group_size', ''):>6}  "
                  f"{origin.get('source', '')}")
