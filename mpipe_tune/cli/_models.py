"""``mpipe-tune models``: the built-in model specs."""

from __future__ import annotations

from mpipe_tune.cli._command import Command


class Models(Command):
    name = "models"
    help = "list the built-in model specs"

    def take_action(self, args):
        from mpipe_tune.inputs import builtin_models, load_model

        for name in builtin_models():
            model = load_model(name)
            print(f"{name:28s} {model.num_layers:4d} layers  blocks: {', '.join(model.blocks())}")
        return 0
