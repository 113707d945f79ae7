"""py-spy's collapsed stacks ("root;...;leaf count" per line) -> flamegraph SVG and speedscope JSON."""

from __future__ import annotations

import html
import json
import re
import zlib
from collections import Counter

from engine.profiling.breakdown import THREAD

_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")
_FRAME = re.compile(r"^(.*) \((.*?)(?::(\d+))?\)$")  # "function (file:line)", or "function (file)"


def _xml_text(text: str) -> str:
    """Text for an SVG: characters XML cannot hold dropped, then escaped. Escape last, after any
    cut, so that an entity (&lt;module&gt;) is never split."""
    return html.escape(_NOT_XML.sub("", text))


def _fit(text: str, chars: int) -> str:
    """The label cut to the box: whole characters, with an ellipsis when cut."""
    if len(text) <= chars:
        return text
    return text[: max(0, chars - 1)] + "\u2026" if chars > 1 else ""


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
        stacks[_frames(stack.split(";"))] += int(count)
    return stacks


def _frames(parts: list[str]) -> tuple[str, ...]:
    """py-spy writes a `;` in a thread's name as it is: the parts after the thread's label that are no
    frame ("function (file:line)") belong to its name."""
    if not parts[0].startswith(THREAD):
        return tuple(parts)
    end = 1
    while end < len(parts) and not _FRAME.match(parts[end]):
        end += 1
    return (";".join(parts[:end]), *parts[end:])


def _function(frame: str) -> str:
    """A frame's function, or a thread's whole label."""
    return frame if frame.startswith(THREAD) else frame.split(" (")[0]


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
                match = None if frame.startswith(THREAD) else _FRAME.match(frame)
                entry = {"name": match.group(1) if match else frame}
                if match and match.group(2):
                    entry["file"] = match.group(2)
                if match and match.group(3):
                    entry["line"] = int(match.group(3))
                frames.append(entry)
            ids.append(index[frame])
        samples.append(ids)
        weights.append(count)
    doc = {
        "$schema": "https://www.speedscope.app/file-format-schema.json",
        "shared": {"frames": frames},
        "profiles": [
            {
                "type": "sampled",
                "name": name,
                "unit": "none",
                "startValue": 0,
                "endValue": sum(weights),
                "samples": samples,
                "weights": weights,
            }
        ],
        "name": name,
        "exporter": "engine profile",
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f)


def write_flamegraph(
    stacks: Counter, title: str, path: str, width: int = 1200, row: int = 17
) -> None:
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
                hue = 20 + (zlib.crc32(_function(frame).encode()) % 40)  # stable across runs
                label = _xml_text(frame)
                text = _xml_text(_fit(_function(frame), int(w / 7)))
                rects.append(
                    f"<g><title>{label}: {child['n']} samples ({100 * child['n'] / total:.1f}%)</title>"
                    f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row - 1}" fill="hsl({hue},85%,60%)"/>'
                    + (
                        f'<text x="{x + 3:.1f}" y="{y + row - 5}" font-size="11">{text}</text>'
                        if w > 30
                        else ""
                    )
                    + "</g>"
                )
                draw(child, x, level + 1)
            x += w

    draw(tree, 0.0, 0)
    with open(path, "w", encoding="utf-8") as f:
        f.write(
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="monospace">'
            f'<text x="4" y="14" font-size="13">{_xml_text(title)} ({total} samples)</text>'
            + "".join(rects)
            + "</svg>\n"
        )
