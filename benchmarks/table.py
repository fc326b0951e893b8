"""Print benchmarks/results.json as a Markdown table (the docs' performance page holds it).

python -m benchmarks.table
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).with_name("results.json")


def table(entries: list[dict[str, object]]) -> str:
    lines = ["| entry | value | baseline | ratio |", "|---|---|---|---|"]
    for e in entries:
        unit = e.get("unit") or ""
        value = f"{e['value']:,.1f} {unit}".strip()
        base = e.get("baseline")
        baseline = "" if base is None else f"{base:,.1f}"
        ratio = e.get("ratio")
        lines.append(f"| `{e['name']}` | {value} | {baseline} | {'' if ratio is None else ratio} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(json.loads(RESULTS.read_text())))
