"""capture_activations: the chosen layers' rows of tapped requests, to disk as safetensors shards.

A dataset for a probe or a sparse autoencoder, written while the engine serves. Requests opt in
with layer_taps=["capture"] (or every request is captured, with ENGINE_CAPTURE_EVERY_REQUEST=1):

    ENGINE_PLUGINS=engine.plugins.capture_activations:CaptureActivations \\
    ENGINE_CAPTURE_DIR=acts ENGINE_CAPTURE_LAYERS=10,20 python run.py

Each shard `capture-<pid>-<n>.safetensors` holds, for its R rows: one tensor per layer
"layer_<i>" [R, hidden] (the model's dtype), "positions" [R], "rid_index" [R] (into the JSON list
of request ids in the metadata's "rids"), "beams" [R] (-1: not a beam search). A shard is written
every ENGINE_CAPTURE_SHARD_ROWS rows and when the scheduler stops. read_shards() loads them back
as one dataset (docs/interpretability.md).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from engine import envvars
from engine.hooks import hookimpl
from engine.taps import LayerTap, TapRows

if TYPE_CHECKING:  # torch loads where rows arrive: the user process and detokenizer need none
    import torch

logger = logging.getLogger(__name__)

TAP_NAME = "capture"


def parse_layers(text: str) -> tuple[int, ...]:
    """ "10, 20,-1" -> (10, 20, -1)."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"layers must be comma-separated integers, got {text!r}") from None


class CaptureActivations:
    """The plugin: arguments left None come from the ENGINE_CAPTURE_* variables."""

    def __init__(
        self,
        directory: str | None = None,
        layers: tuple[int, ...] | None = None,
        point: str | None = None,
        shard_rows: int | None = None,
        every_request: bool | None = None,
    ) -> None:
        self.directory = Path(directory or envvars.read("ENGINE_CAPTURE_DIR"))
        self.layers = tuple(layers or parse_layers(envvars.read("ENGINE_CAPTURE_LAYERS")))
        self.point = point or envvars.read("ENGINE_CAPTURE_POINT")
        self.shard_rows = shard_rows or int(envvars.read("ENGINE_CAPTURE_SHARD_ROWS"))
        if every_request is None:
            every_request = envvars.read("ENGINE_CAPTURE_EVERY_REQUEST") == "1"
        self.every_request = every_request
        if not self.layers or self.shard_rows < 1:
            raise ValueError("capture_activations needs at least one layer and shard_rows >= 1")
        self._lock = threading.Lock()  # the serving thread taps while the stop hook flushes
        self._values: dict[int, list[torch.Tensor]] = {}  # layer -> this shard's row blocks
        self._rows: list[tuple[list[str], list[int], list[int | None]]] = []  # one per step
        self._pending = 0  # rows of the first tapped layer not yet written
        self._shards = 0
        self._written = 0

    @hookimpl
    def engine_layer_taps(self) -> list[LayerTap]:
        return [
            LayerTap(
                name=TAP_NAME,
                layers=self.layers,
                points=(self.point,),
                fn=self.on_rows,
                every_request=self.every_request,
            )
        ]

    def on_rows(self, rows: TapRows) -> None:
        """One step's rows at one layer, kept on the CPU. Every layer of a step has the same rows:
        the step's first call records rids and positions, and writes the shard once it is full, so
        a shard holds whole steps (at least shard_rows rows, but the last)."""
        block = rows.values.detach().to("cpu", copy=True)
        with self._lock:
            if len(self._values.get(rows.layer, ())) == len(self._rows):  # a new step
                if self._pending >= self.shard_rows:
                    self._flush()
                self._rows.append((list(rows.rids), list(rows.positions), list(rows.beams)))
                self._pending += block.shape[0]
            self._values.setdefault(rows.layer, []).append(block)

    def _flush(self) -> None:
        """Write the held rows as one shard (atomically: readers never see half a file)."""
        if not self._rows:
            return
        import torch
        from safetensors.torch import save_file

        rids: list[str] = []
        index: dict[str, int] = {}
        rid_index, positions, beams = [], [], []
        for step_rids, step_positions, step_beams in self._rows:
            for rid, pos, beam in zip(step_rids, step_positions, step_beams):
                rid_index.append(index.setdefault(rid, len(index)))
                if len(index) > len(rids):
                    rids.append(rid)
                positions.append(pos)
                beams.append(-1 if beam is None else beam)
        tensors = {f"layer_{layer}": torch.cat(b) for layer, b in sorted(self._values.items())}
        tensors["positions"] = torch.tensor(positions, dtype=torch.int64)
        tensors["rid_index"] = torch.tensor(rid_index, dtype=torch.int64)
        tensors["beams"] = torch.tensor(beams, dtype=torch.int64)
        meta = {
            "rids": json.dumps(rids),
            "point": self.point,
            "layers": json.dumps(sorted(self._values)),
        }
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"capture-{os.getpid()}-{self._shards:05d}.safetensors"
        save_file(tensors, str(path.with_suffix(".tmp")), metadata=meta)
        os.replace(path.with_suffix(".tmp"), path)
        self._shards += 1
        self._written += len(positions)
        self._values, self._rows, self._pending = {}, [], 0

    @hookimpl
    def engine_process_stop(self, role: str) -> None:
        if role != "scheduler":
            return
        with self._lock:
            # stopped inside a step: that step is dropped, the layers of a shard stay aligned
            steps = min((len(b) for b in self._values.values()), default=0)
            self._values = {layer: b[:steps] for layer, b in self._values.items()}
            self._rows = self._rows[:steps]
            self._flush()

    @hookimpl
    def engine_stats(self, role: str) -> dict | None:
        if role != "scheduler":
            return None
        with self._lock:
            held = sum(len(r[1]) for r in self._rows)
            return {"shards": self._shards, "rows_written": self._written, "rows_held": held}


def read_shards(directory: str, latest: bool = True) -> dict:
    """Every shard in directory as one dataset: {"layer_<i>": [N, hidden], "positions": [N],
    "beams": [N], "rids": list of N request ids}. A request recomputed after a retraction has its
    positions twice; latest=True keeps one row per (rid, beam, position): the last written."""
    import torch
    from safetensors import safe_open

    parts: dict[str, list[torch.Tensor]] = {}
    rids: list[str] = []
    for path in sorted(Path(directory).glob("capture-*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names = json.loads(f.metadata()["rids"])
            for key in f.keys():
                if key != "rid_index":
                    parts.setdefault(key, []).append(f.get_tensor(key))
            rids.extend(names[i] for i in f.get_tensor("rid_index").tolist())
    data = {key: torch.cat(blocks) for key, blocks in parts.items()}
    if latest and rids:
        last: dict[tuple, int] = {}
        for row, key in enumerate(zip(rids, data["beams"].tolist(), data["positions"].tolist())):
            last[key] = row
        keep = sorted(last.values())
        data = {key: t[keep] for key, t in data.items()}
        rids = [rids[i] for i in keep]
    data["rids"] = rids
    return data
