"""Atomic file writes: a temp file beside the target, synced, then renamed into place."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


@contextmanager
def atomic_file(path: Path, mode: str = "wb") -> Iterator[IO]:
    """Yield a file to write; when the block ends, fsync it and rename it to `path`. On error nothing is left."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, data: Any) -> None:
    with atomic_file(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
