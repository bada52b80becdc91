"""``python -m mpipe_tune.cli``: the ``mpipe-tune`` command."""

import sys

from mpipe_tune.cli import main

sys.exit(main())
