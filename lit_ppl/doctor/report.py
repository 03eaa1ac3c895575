"""The doctor's report for people and programs: Rich tables on the terminal, the JSON file, the verdict lines."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lit_ppl.runtime.files import write_text_atomic

GIB = 1024**3


def _gib(num_bytes: int | None) -> str:
    """Formats bytes as GiB for the table."""
    return "?" if num_bytes is None else f"{num_bytes / GIB:.1f}"


def _describe_devices(devices: Sequence[Mapping[str, Any]]) -> str:
    """One line per device, for a table cell."""
    lines = []
    for dev in devices:
        if dev["type"] == "cpu":
            lines.append(f"cpu, {dev['cores']} cores, {_gib(dev['total_bytes'])} GiB RAM")
        else:
            lines.append(
                f"cuda:{dev['index']} {dev['name']} {_gib(dev['free_bytes'])}/{_gib(dev['total_bytes'])} GiB free"
            )
    return "\n".join(lines)


def print_report(report: Mapping[str, Any]) -> None:
    """Prints the per-rank table, the versions and the checks with Rich.

    Args:
        report: The gathered report, as written by ``--json``.
    """
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    ranks = Table(title=f"lit-ppl doctor: {report['world_size']} rank(s), backend {report['backend']}")
    for column in ("rank", "node", "local", "host", "world", "master", "devices"):
        ranks.add_column(column, justify="right" if column in {"rank", "node", "local", "world"} else "left")
    for info in report["ranks"]:
        master = "n/a" if info["master_addr"] is None else f"{info['master_addr']}:{info['master_port']}"
        ranks.add_row(
            str(info["rank"]),
            str(info["node_rank"]),
            str(info["local_rank"]),
            escape(info["hostname"]),
            str(info["world_size"]),
            escape(master),
            escape(_describe_devices(info["devices"])),
        )
    console.print(ranks)

    versions = Table(title="versions")
    versions.add_column("package")
    versions.add_column("version")
    for package in report["ranks"][0]["versions"]:
        seen = sorted({info["versions"].get(package, "?") for info in report["ranks"]})
        versions.add_row(package, escape(seen[0] if len(seen) == 1 else "MISMATCH: " + ", ".join(seen)))
    console.print(versions)

    checks = Table(title="checks")
    checks.add_column("check")
    checks.add_column("result")
    checks.add_column("detail")
    for check in report["checks"]:
        verdict = "[green]pass[/green]" if check["ok"] else "[red]FAIL[/red]"
        checks.add_row(check["name"], verdict, escape(check["detail"]))
    console.print(checks)


def write_report(path: Path, report: Mapping[str, Any]) -> Path:
    """Writes the report as indented JSON, atomically, so a reader never sees half of it.

    Args:
        path: The ``--json`` file.
        report: The gathered report.

    Returns:
        ``path``.
    """
    # Not write_json_atomic: that refuses NaN, and a corrupted all_reduce is exactly when "got" holds one.
    return write_text_atomic(path, json.dumps(report, indent=2) + "\n")


def print_verdict(report: Mapping[str, Any]) -> None:
    """Prints the one-line ``OK`` summary on stdout, or one ``FAILED`` line per problem on stderr.

    Args:
        report: The gathered report.
    """
    if report["ok"]:
        reduce_ms, barrier_ms = report["checks"][1]["ms"], report["checks"][2]["ms"]
        print(
            f"OK: {report['world_size']} rank(s), backend {report['backend']}, "
            f"all_reduce {reduce_ms:.2f} ms, barrier {barrier_ms:.2f} ms"
        )
    else:
        for problem in report["problems"]:
            print(f"FAILED: {problem}", file=sys.stderr)
