"""What this machine has: cores, memory, GPU. Detected without importing torch
(the network process must stay light), through psutil and `nvidia-smi`."""

from __future__ import annotations

import os
import shutil
import subprocess

import psutil

from murmur.node.core.roles import HARDWARE_CLASSES, Hardware


def _gpu() -> tuple[str, int]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return "", 0
    try:
        out = subprocess.run(
            [exe, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return "", 0
    line = out.strip().splitlines()[0] if out.strip() else ""
    if "," not in line:
        return "", 0
    name, mem = line.rsplit(",", 1)
    try:
        return name.strip(), int(float(mem)) * 2**20
    except ValueError:
        return name.strip(), 0


def detect() -> Hardware:
    name, mem = _gpu()
    return Hardware(
        cpu_count=os.cpu_count() or 1, memory_bytes=psutil.virtual_memory().total, gpu_name=name, gpu_memory_bytes=mem
    )


def hardware_class(configured: str, hw: Hardware | None = None) -> str:
    """`node.hardware` from config, or the detected class when it is `auto`."""
    if configured != "auto":
        if configured not in HARDWARE_CLASSES:
            from murmur.gossip.errors import ConfigError

            raise ConfigError(f"node.hardware: {configured!r} is not one of auto, {', '.join(HARDWARE_CLASSES)}")
        return configured
    return (hw or detect()).klass


def available_memory() -> int:
    return psutil.virtual_memory().available


def rss_bytes(pids: list[int] | None = None) -> int:
    """Resident memory of this process and the given children."""
    total = psutil.Process().memory_info().rss
    for pid in pids or []:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            pass
    return total
