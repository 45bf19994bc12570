"""The names a checkpoint's files and folders have, wherever they are stored."""

from __future__ import annotations

import re

#: A published checkpoint's folder: ``step-00000042``.
NAME = re.compile(r"^step-(\d{8,})$")
#: The manifest, written last: its presence is the publication.
MANIFEST = "COMPLETE"


def step_name(step: int) -> str:
    """The published folder of ``step``."""
    return f"step-{step:08d}"
