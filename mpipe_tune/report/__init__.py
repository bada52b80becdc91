"""Reports: tables, Gantt charts, the HTML report, ``bench``'s records, re-predicting a stored plan, and
:mod:`.exports`, the export targets.

Its public API is :data:`__all__`: what the command line and users import, each name loaded from its
module when first asked for (:data:`_LAZY`), except :func:`repredict`, bound here because its module
shares its name. Nothing here imports the search (tests/test_layering.py).
"""

from mpipe_tune import lazy_exports
from mpipe_tune.report._repredict import repredict

_LAZY = {
    "mpipe_tune.report._bench": (
        "bench_plans", "bench_record", "format_bench", "progress_line", "round_robin", "validate_rounds",
    ),
    "mpipe_tune.report._dataset": ("distribution_record", "draw_distribution", "print_distribution"),
    "mpipe_tune.report.exports": (
        "TARGETS", "ExportPlan", "ExportTarget", "TwoFiles", "export_outputs", "read_export_plan",
    ),
    "mpipe_tune.report._gantt": (
        "action_spans", "draw_gantt", "draw_measured_gantt", "draw_prediction", "validate_picture_path", "zero_of",
    ),
    "mpipe_tune.report._html": ("HTML_SUFFIXES", "build_report", "render", "validate_html_path"),
    "mpipe_tune.report._tables": ("prediction_record", "print_derivation", "print_prediction"),
}
__all__ = ["repredict", *(n for names in _LAZY.values() for n in names)]
__getattr__ = lazy_exports(__name__, _LAZY)
