"""What the tool writes, below every layer that writes: :mod:`.files` (output paths checked before any
work, files written atomically and together) and :mod:`.frames` (tables as pandas frames, fixed-width
text and CSV). It imports nothing of the package but its errors."""
