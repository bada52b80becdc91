"""``mpipe-tune profiles``: the built-in hardware profiles."""

from __future__ import annotations

from mpipe_tune.cli._command import Command


class Profiles(Command):
    name = "profiles"
    help = "list the built-in hardware profiles"

    def take_action(self, args):
        from mpipe_tune.cost import builtin_profiles, load_profile

        names = builtin_profiles()
        width = max(map(len, names))
        for name in names:
            p = load_profile(name)
            peaks = ", ".join(f"{k} {v / 1e12:.4g} TFLOP/s" for k, v in sorted(p.peak_flops_per_s.items()))
            print(f"{name:{width}s} {p.device}: {peaks}; {p.memory_bytes_per_s / 1e9:.4g} GB/s, "
                  f"{p.memory_capacity_bytes / 2**30:.4g} GiB")
        return 0
