"""``mpipe-tune workload``: a dataset's distribution as the model sees it."""

from __future__ import annotations

import json
from pathlib import Path

from mpipe_tune.cli._arguments import add_dataset_arguments, dataset_options, print_notes
from mpipe_tune.cli._command import Command


class Workload(Command):
    name = "workload"
    after_interrupt = "nothing written"
    help = "a dataset's distribution as a model sees it: images per sample, image and text tokens (percentiles)"

    def add_arguments(self, parser):
        parser.add_argument("data", help="a LLaVA/ShareGPT .json/.jsonl, or a .csv/.parquet/.jsonl manifest")
        parser.add_argument("--model", default="example-mllm",
                            help="built-in model, YAML file or Hugging Face folder whose image and text rules "
                                 "apply (default: example-mllm)")
        add_dataset_arguments(parser)
        parser.add_argument("--plot", default=None, metavar="PNG", help="draw the distributions into this PNG")
        parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")

    def take_action(self, args):
        from mpipe_tune.errors import MpipeError
        from mpipe_tune.report import distribution_record, draw_distribution, print_distribution
        from mpipe_tune.inputs import load_model, is_dataset, load_dataset

        if args.plot:
            from mpipe_tune.report import validate_picture_path

            validate_picture_path(args.plot, label="--plot")
        if Path(args.data).suffix and not Path(args.data).exists():
            raise MpipeError(f"dataset {args.data} is not a file; give a LLaVA/ShareGPT .json/.jsonl or a "
                             f".csv/.parquet/.jsonl manifest")
        if not is_dataset(args.data):
            raise MpipeError(f"{args.data} is not a dataset: give a LLaVA/ShareGPT .json list or .jsonl, or a "
                             f".csv/.parquet/.jsonl manifest")
        model = load_model(args.model)
        dataset, notes = load_dataset(args.data, args.model, model, dataset_options(args))
        print_notes(self.name, notes)
        record = distribution_record(dataset)
        if args.plot:
            draw_distribution(dataset, args.plot)
        if args.json:
            print(json.dumps(record, indent=2))
        else:
            print_distribution(record)
            if args.plot:
                print(f"\nhistograms written to {args.plot}")
        return 0
