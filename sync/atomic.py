"""Crash-safe file writes: temp file in the same folder, fsync, rename, fsync the folder.

`durable=False` keeps the rename (readers never see a half-written file) but skips both fsyncs:
for caches whose every file is re-verified when read back, such as a download's chunks, where a
crash may lose the newest files but cannot make a torn one count.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from pathlib import Path


def atomic_write(path: Path, data: bytes | memoryview | Iterable[bytes], durable: bool = True) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # one temp file per writer: two threads storing the same file (one patch completed by two transfers)
    # must not truncate each other's temp file, nor lose the rename
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            if isinstance(data, (bytes, bytearray, memoryview)):
                f.write(data)
            else:
                for part in data:
                    f.write(part)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if not durable:
        return
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
