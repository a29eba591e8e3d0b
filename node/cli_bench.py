"""`murmur bench ...`: each benchmark lives beside the code it measures; this only wires and prints."""

from __future__ import annotations

from typing import Annotated

import typer

from node.cli import bench_app, emit_json

JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON object as the last line (always on)")]
