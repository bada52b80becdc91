"""mpipe-tune: plan, predict and run pipeline-parallel MLLM training with the Mpipe schedule algebra."""

from mpipe_tune.errors import MpipeError

__all__ = ["MpipeError"]
__version__ = "0.1.0"
