"""What the tool writes, below every layer that writes: :mod:`._files` (output paths checked before any
work, files written atomically and together) and :mod:`._frames` (tables as pandas frames, fixed-width
text and CSV). It imports nothing of the package but its errors.

Its public API is :data:`__all__`, each name loaded from its module when first asked for (:data:`_LAZY`:
pandas loads only with the tables)."""

from mpipe_tune import lazy_exports

_LAZY = {
    "mpipe_tune.outputs._files": ("validate_out_path", "write_atomic", "write_together"),
    "mpipe_tune.outputs._frames": (
        "MISSING", "Cell", "Column", "TextTable", "format_frame", "format_markdown", "gib", "is_missing", "ms",
        "text", "to_csv_text",
    ),
}
__all__ = [n for names in _LAZY.values() for n in names]
__getattr__ = lazy_exports(__name__, _LAZY)
