"""One request's spans as a timeline picture (PNG): the span tree, one row per span, bars coloured by
process, and below it the scheduler steps that served the request (found through their links)."""

from __future__ import annotations

from collections import defaultdict

from PIL import Image, ImageDraw, ImageFont

from engine.tracing.otlp_json import SpanRecord

COLORS = {"user": (66, 133, 244), "scheduler": (234, 134, 0), "detokenizer": (52, 168, 83)}
STEP_COLORS = {"prefill": (156, 39, 176), "decode": (121, 134, 203)}
ERROR = (217, 48, 37)


def request_traces(spans: list[SpanRecord]) -> list[tuple[str, str, str]]:
    """(trace id, request id, root span name) of every request trace, in start order."""
    roots = [
        s
        for s in spans
        if "engine.request_id" in s.attributes
        and s.role == "user"
        and "gen_ai.operation.name" in s.attributes
    ]
    return [
        (s.trace_id, str(s.attributes["engine.request_id"]), s.name)
        for s in sorted(roots, key=lambda s: s.start_ns)
    ]


def pick(
    spans: list[SpanRecord], request_id: str | None = None, trace_id: str | None = None
) -> tuple[str, str | None]:
    """(trace id, request id or None: the whole trace) to draw; default the first request."""
    traces = request_traces(spans)
    if trace_id:
        if not any(s.trace_id == trace_id for s in spans):
            raise ValueError(f"no span of trace {trace_id} in the file")
        return trace_id, None
    if request_id:
        for tid, rid, _ in traces:
            if rid == request_id:
                return tid, rid
        listed = ", ".join(r for _, r, _ in traces[:10]) + (", ..." if len(traces) > 10 else "")
        raise ValueError(f"no request {request_id!r} in the file (requests: {listed or 'none'})")
    if not traces:
        raise ValueError(
            "no request trace in the file (is it from an engine run with ENGINE_TRACING=1?)"
        )
    return traces[0][0], traces[0][1]


def _tree(spans: list[SpanRecord]) -> list[tuple[int, SpanRecord]]:
    """Depth-first, children by start time; spans whose parent is elsewhere (another trace) are roots."""
    ids = {s.span_id for s in spans}
    children: dict[str, list[SpanRecord]] = defaultdict(list)
    for s in spans:
        children[s.parent_span_id if s.parent_span_id in ids else ""].append(s)
    out: list[tuple[int, SpanRecord]] = []

    def walk(parent: str, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda s: (s.start_ns, -s.end_ns)):
            out.append((depth, s))
            walk(s.span_id, depth + 1)

    walk("", 0)
    return out


def _font(size: int):
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: a fixed bitmap font
        return ImageFont.load_default()


def draw_timeline(
    spans: list[SpanRecord],
    path: str,
    request_id: str | None = None,
    trace_id: str | None = None,
    width: int = 1400,
) -> str:
    """Draw the chosen request's spans (default: the first request), or a whole trace, to `path`;
    returns the trace id. Requests sharing a caller's trace are told apart by their request id."""
    tid, rid = pick(spans, request_id, trace_id)
    mine = [
        s
        for s in spans
        if s.trace_id == tid and (rid is None or s.attributes.get("engine.request_id") == rid)
    ]
    rows = _tree(mine)
    span_ids = {s.span_id for s in mine}
    steps = [
        s
        for s in spans
        if "engine.step.mode" in s.attributes
        and not s.parent_span_id
        and any(ln["trace_id"] == tid and ln["span_id"] in span_ids for ln in s.links)
    ]
    t0 = min(s.start_ns for s in mine)
    t1 = max([s.end_ns for s in mine] + [s.end_ns for s in steps])
    span_ns = max(t1 - t0, 1)
    font, small = _font(14), _font(12)
    label_w, row_h, top, pad = 360, 26, 50, 20
    n_rows = len(rows) + (1 if steps else 0)
    height = top + n_rows * row_h + 60
    img = Image.new("RGB", (width, height), "white")
    d = ImageDraw.Draw(img)
    plot_w = width - label_w - pad

    def x(ns: int) -> float:
        return label_w + (ns - t0) / span_ns * plot_w

    root = rows[0][1] if rows else mine[0]
    shown = rid or root.attributes.get("engine.request_id", "")
    d.text((pad, 12), f"{root.name}   request {shown}   trace {tid}", fill="black", font=font)
    # time axis: about 8 ticks at a round number of ms
    total_ms = span_ns / 1e6
    step_ms = next(
        (
            m
            for m in (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
            if total_ms / m <= 8
        ),
        20000,
    )
    axis_y = top + n_rows * row_h + 8
    d.line([(label_w, axis_y), (label_w + plot_w, axis_y)], fill="black")
    tick = 0.0
    while tick <= total_ms + 1e-9:
        tx = x(t0 + int(tick * 1e6))
        d.line([(tx, top - 4), (tx, axis_y + 4)], fill=(225, 225, 225))
        d.text((tx - 10, axis_y + 8), f"{tick:g} ms", fill="black", font=small)
        tick += step_ms
    for i, (depth, s) in enumerate(rows):
        y = top + i * row_h
        color = COLORS.get(s.role, (128, 128, 128))
        name = s.name if len(s.name) <= 30 - 2 * depth else s.name[: 28 - 2 * depth] + "..."
        d.text((pad + depth * 16, y + 5), name, fill="black", font=font)
        d.text((label_w - 95, y + 6), f"{s.role}", fill=color, font=small)
        x0, x1 = x(s.start_ns), max(x(s.end_ns), x(s.start_ns) + 2)
        d.rectangle(
            [x0, y + 4, x1, y + row_h - 4],
            fill=color,
            outline=ERROR if s.status_code == 2 else None,
            width=2,
        )
        ms = s.duration_ns / 1e6
        label = f"{ms:.1f} ms" if ms >= 0.1 else f"{s.duration_ns / 1e3:.0f} us"
        if x1 + 70 < label_w + plot_w:
            d.text((x1 + 4, y + 6), label, fill="black", font=small)
        elif x1 - x0 > 80:
            d.text((x0 + 4, y + 6), label, fill="white", font=small)
        else:
            d.text((x0 - 70, y + 6), label, fill="black", font=small)
    if steps:
        y = top + len(rows) * row_h
        d.text((pad, y + 5), f"steps serving it ({len(steps)})", fill="black", font=font)
        d.text((label_w - 95, y + 6), "scheduler", fill=COLORS["scheduler"], font=small)
        for k, s in enumerate(sorted(steps, key=lambda s: s.start_ns)):
            color = STEP_COLORS.get(str(s.attributes.get("engine.step.mode")), (128, 128, 128))
            if k % 2:  # every other step a shade lighter, so neighbours stay apart at any scale
                color = tuple(min(255, c + 45) for c in color)
            d.rectangle(
                [x(s.start_ns), y + 4, max(x(s.end_ns) - 1, x(s.start_ns) + 1), y + row_h - 4],
                fill=color,
            )
    legend = [
        ("user", COLORS["user"]),
        ("scheduler", COLORS["scheduler"]),
        ("detokenizer", COLORS["detokenizer"]),
    ]
    if steps:
        legend += [("prefill step", STEP_COLORS["prefill"]), ("decode step", STEP_COLORS["decode"])]
    lx = label_w
    for name, color in legend:
        d.rectangle([lx, height - 22, lx + 12, height - 10], fill=color)
        d.text((lx + 16, height - 24), name, fill="black", font=small)
        lx += 30 + int(d.textlength(name, font=small))
    img.save(path)
    return tid
