"""``python -m sparktrain`` is the ``sparktrain`` command."""

import sys

from sparktrain.cli import main

sys.exit(main())
