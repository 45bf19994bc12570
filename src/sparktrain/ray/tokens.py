"""A per-cluster token in a file only this user can read: Ray's, and its job server's.

Both tokens of a Ray on Spark cluster (:mod:`sparktrain.ray.on_spark`) are made here: 256 bits
from :mod:`secrets`, as Ray's own generator, in a fresh 0700 folder, the file 0600.
"""

from __future__ import annotations

import os
import secrets
import tempfile


def write_token() -> tuple[str, str]:
    """A fresh cluster token, written to a file only this user can read; (token, path)."""
    folder = tempfile.mkdtemp(prefix="sparktrain-ray-auth-")  # created 0700
    path = os.path.join(folder, "token")
    token = secrets.token_hex(32)  # 256 bits, as Ray's own generator
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(token)
    return token, path
