"""py-spy's collapsed stacks ("root;...;leaf count" per line) -> flamegraph SVG and speedscope JSON."""

from __future__ import annotations

import html
import json
from collections import Counter


def parse_collapsed(text: str) -> Counter:
    """{(frame, ..., frame): samples}, root first."""
    stacks: Counter = Counter()
    for line in text.splitlines():
        line = line.rstrip()
        if not line:
            continue
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        stacks[tuple(stack.split(";"))] += int(count)
    return stacks


def write_speedscope(stacks: Counter, name: str, path: str) -> None:
    """A speedscope "sampled" profile (https://www.speedscope.app), one sample per stack count."""
    frames: list[dict] = []
    index: dict[str, int] = {}
    samples, weights = [], []
    for stack, count in stacks.items():
        ids = []
        for frame in stack:
            if frame not in index:
                index[frame] = len(frames)
                func, _, where = frame.partition(" (")
                file, _, line = where.rstrip(")").rpartition(":")
                entry = {"name": func}
                if file:
                    entry["file"] = file
                if line.isdigit():
                    entry["line"] = int(line)
                frames.append(entry)
            ids.append(index[frame])
        samples.append(ids)
        weights.append(count)
    doc = {
        "$schema": "https://www.speedscope.app/file-format-schema.json",
        "shared": {"frames": frames},
        "profiles": [{"type": "sampled", "name": name, "unit": "none", "startValue": 0,
                      "endValue": sum(weights), "samples": samples, "weights": weights}],
        "name": name,
        "exporter": "engine profile",
    }  # fmt: skip
    with open(path, "w") as f:
        json.dump(doc, f)


def write_flamegraph(stacks: Counter, title: str, path: str, width: int = 1200, row: int = 17) -> None:
    """A static flamegraph SVG: x = share of samples, y = stack depth, widths summed per call path."""
    tree: dict = {"n": 0, "c": {}}
    for stack, count in stacks.items():
        node = tree
        node["n"] += count
        for frame in stack:
            node = node["c"].setdefault(frame, {"n": 0, "c": {}})
            node["n"] += count
    total = tree["n"] or 1
    depth = max((len(s) for s in stacks), default=0)
    height = (depth + 3) * row
    rects: list[str] = []

    def draw(node: dict, x: float, level: int) -> None:
        for frame, child in sorted(node["c"].items()):
            w = child["n"] / total * width
            if w >= 0.5:
                y = height - (level + 2) * row
                hue = 20 + (hash(frame.split(" (")[0]) % 40)
                label = html.escape(frame)
                text = html.escape(frame.split(" (")[0])
                rects.append(
                    f'<g><title>{label}: {child["n"]} samples ({100 * child["n"] / total:.1f}%)</title>'
                    f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row - 1}" fill="hsl({hue},85%,60%)"/>'
                    + (f'<text x="{x + 3:.1f}" y="{y + row - 5}" font-size="11">{text[: int(w / 7)]}</text>' if w > 30 else "")
                    + "</g>"
                )
                draw(child, x, level + 1)
            x += w

    draw(tree, 0.0, 0)
    with open(path, "w") as f:
        f.write(
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="monospace">'
            f'<text x="4" y="14" font-size="13">{html.escape(title)} ({total} samples)</text>' + "".join(rects) + "</svg>\n"
        )
