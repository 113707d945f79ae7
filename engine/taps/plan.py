"""One step's taps: at each (layer, point) some requests asked for, the rows to steer, to hand to
plugin taps and to capture. The model calls `at` after computing a point; nothing else changes."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.taps.plugin import LayerTap, TapRows
from engine.taps.request import RequestTaps


@dataclass
class Segment:
    """A request's consecutive rows in the step: `count` rows from `row`, positions from `pos`."""

    rid: str
    taps: RequestTaps | None
    row: int
    pos: int
    count: int
    beam: int | None = None


@dataclass
class _PluginRows:
    tap: LayerTap
    rows: list[int] = field(default_factory=list)
    rids: list[str] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    beams: list[int | None] = field(default_factory=list)


@dataclass
class Site:
    """What happens at one (layer, point): steer, then plugin taps, then capture."""

    steer_rows: list[int] = field(default_factory=list)
    steer_vecs: list[tuple[torch.Tensor, int]] = field(default_factory=list)  # (vector, rows)
    plugins: dict[str, _PluginRows] = field(default_factory=dict)
    capture_rows: list[int] = field(default_factory=list)
    captured: torch.Tensor | None = None
    # built by finalize()
    steer: tuple[torch.Tensor, torch.Tensor] | None = None
    capture: torch.Tensor | None = None
    plugin_index: list[tuple[_PluginRows, torch.Tensor]] = field(default_factory=list)


class TapPlan:
    def __init__(self, mode: str, model=None) -> None:
        self.mode, self.model = mode, model
        self.sites: dict[tuple[int, str], Site] = {}
        self.resid_layers: frozenset[int] = frozenset()
        # (where the rows go, [(site, offset in its captured rows)] per layer, rows)
        self.deliveries: list[tuple[list[torch.Tensor], list[tuple[Site, int]], int]] = []
        self.failed: dict[str, str] = {}  # rid -> why a plugin tap failed on its rows

    def site(self, layer: int, point: str) -> Site:
        return self.sites.setdefault((layer, point), Site())

    def add(self, seg: Segment, extra: list[LayerTap]) -> None:
        """Put one request's rows into the sites its steering, taps and hidden states use."""
        rt = seg.taps
        rows = range(seg.row, seg.row + seg.count)
        taps = list(extra) + (list(rt.taps) if rt is not None else [])
        for tap in dict.fromkeys(taps):
            for layer in tap.layers:
                for point in tap.points:
                    pr = self.site(layer, point).plugins.setdefault(tap.name, _PluginRows(tap))
                    pr.rows += rows
                    pr.rids += [seg.rid] * seg.count
                    pr.positions += range(seg.pos, seg.pos + seg.count)
                    pr.beams += [seg.beam] * seg.count
        if rt is None:
            return
        for layer, vec in rt.steer.items():
            s = self.site(layer, "resid_post")
            s.steer_rows += rows
            s.steer_vecs.append((vec, seg.count))
        spec = rt.hidden
        # a beam row's states are its beam's own: add_beam_rows, not the request's positions
        span = rt.wanted(seg.pos, seg.count) if spec is not None and seg.beam is None else None
        if span is None:
            return
        a, b = span
        self._capture(rt, rt.chunks, seg.row + a - seg.pos, b - a)

    def add_beam_rows(self, rt: RequestTaps, row: int, count: int) -> None:
        """A beam search's rows of this decode step, one per beam from `row`, for its hidden states:
        delivered to rt.beam_step as [layers, count, hidden]."""
        self._capture(rt, rt.beam_step, row, count)

    def _capture(self, rt: RequestTaps, dest: list[torch.Tensor], first: int, count: int) -> None:
        places = []
        for layer in rt.hidden.layers:
            s = self.site(layer, rt.hidden.point)
            places.append((s, len(s.capture_rows)))
            s.capture_rows += range(first, first + count)
        self.deliveries.append((dest, places, count))

    def finalize(self, device) -> TapPlan | None:
        """Index tensors for each site; None when nothing is tapped at all."""
        if not self.sites:
            return None
        for s in self.sites.values():
            if s.steer_rows:
                vecs = torch.stack([v for v, _ in s.steer_vecs])
                counts = torch.tensor([n for _, n in s.steer_vecs], device=vecs.device)
                s.steer = (
                    torch.tensor(s.steer_rows, dtype=torch.int64, device=device),
                    vecs.repeat_interleave(counts, dim=0),
                )
            if s.capture_rows:
                s.capture = torch.tensor(s.capture_rows, dtype=torch.int64, device=device)
            s.plugin_index = [
                (pr, torch.tensor(pr.rows, dtype=torch.int64, device=device))
                for pr in s.plugins.values()
            ]
        self.resid_layers = frozenset(i for i, p in self.sites if p == "resid_post")
        return self

    def at(self, layer: int, point: str, x: torch.Tensor) -> torch.Tensor:
        """x [rows, hidden] at this point of this layer, steered and changed by the taps there."""
        s = self.sites.get((layer, point))
        if s is None:
            return x
        if s.steer is not None:
            rows, vecs = s.steer
            x.index_add_(0, rows, vecs.to(x.dtype))
        for pr, rows in s.plugin_index:
            self._run(pr, rows, layer, point, x)
        if s.capture is not None:
            s.captured = x.index_select(0, s.capture)
        return x

    def _run(
        self, pr: _PluginRows, rows: torch.Tensor, layer: int, point: str, x: torch.Tensor
    ) -> None:
        """A plugin tap's fn on its rows; its error fails those rows' requests, not the step."""
        values = x.index_select(0, rows)
        tap = pr.tap
        try:
            tap.fn(
                TapRows(
                    layer, point, values, pr.rids, pr.positions, pr.beams, self.mode, self.model
                )
            )
        except Exception as exc:  # noqa: BLE001 - a plugin's failure is its requests' alone
            message = f"plugin {tap.plugin!r} failed in layer tap {tap.name!r}: {type(exc).__name__}: {exc}"
            for rid in pr.rids:
                self.failed.setdefault(rid, message)
            return
        if tap.writes:
            x.index_copy_(0, rows, values.to(x.dtype))

    def deliver(self) -> None:
        """After the forward pass: each request's captured rows, [layers, rows, hidden] float32."""
        for dest, places, count in self.deliveries:
            parts = [s.captured[off : off + count] for s, off in places]
            dest.append(torch.stack(parts).float().cpu())  # held off the device till it ends
