"""mpipe-tune: plan, predict and run pipeline-parallel MLLM training with the Mpipe schedule algebra.

The package imports nothing when it is imported (``MpipeError`` is looked up when first asked for), so that the
command line's entry point handles Ctrl-C from its first line (see :mod:`mpipe_tune.cli`)."""

__all__ = ["MpipeError"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "MpipeError":
        from mpipe_tune.errors import MpipeError

        return MpipeError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
