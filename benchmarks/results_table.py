"""What every benchmark script does with its table: print it, and write it to ``--out`` when given."""

from __future__ import annotations

from pathlib import Path


def emit_table(lines: list[str], out: str | None) -> None:
    """Print the markdown ``lines``; also write them to ``out`` (parent folders created) when it is set."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
