"""mpipe-tune: plan, predict and run pipeline-parallel MLLM training with the Mpipe schedule algebra.

The package imports nothing when it is imported (``MpipeError`` is looked up when first asked for), so that the
command line's entry point handles Ctrl-C from its first line (see :mod:`mpipe_tune.cli`)."""

__all__ = ["MpipeError"]
__version__ = "0.1.0"


def lazy_exports(package: str, exports: dict[str, tuple[str, ...]]):
    """The module ``__getattr__`` of a package whose public names (``exports``: module -> the names it
    defines) are imported from their modules when first asked for, so that importing the package costs
    nothing and a heavy dependency (torch, Optuna, matplotlib) loads only for the names that need it.

    A package lists ``exports`` as ``_LAZY`` beside its ``__all__``; tests/test_layering.py reads it
    to see through ``from package import name`` to the module that defines ``name``."""
    where = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        import importlib

        # read from the module each time, not kept here: a test that patches the module's name is seen
        return getattr(importlib.import_module(where[name]), name)

    return __getattr__


def __getattr__(name: str):
    if name == "MpipeError":
        from mpipe_tune.errors import MpipeError

        return MpipeError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
