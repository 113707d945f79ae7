"""logit_lens: each chosen layer's residual stream through the final norm and lm_head, per token.

For every tapped request (layer_taps=["logit_lens"]) and every position that predicts a generated
token (the last prompt token's, then each generated token's), it keeps the top-k next tokens each
layer would predict, with their probabilities: where the answer forms, layer by layer.

    ENGINE_PLUGINS=engine.plugins.logit_lens:LogitLens ENGINE_LOGIT_LENS_LAYERS=0,10,20,29 python run.py

A finished request's record is in engine.get_stats()["plugins"]["scheduler"][<plugin name>]
["requests"][rid] (the last KEEP requests), and one JSON line per request goes to
ENGINE_LOGIT_LENS_FILE when that is set. table(record, tokenizer) prints one.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict

from engine import envvars
from engine.hooks import hookimpl
from engine.taps import LayerTap, TapRows

logger = logging.getLogger(__name__)

TAP_NAME = "logit_lens"
KEEP = 64  # finished requests' records engine_stats shows


def parse_layers(text: str) -> tuple[int, ...]:
    """ "0, 10,-1" -> (0, 10, -1)."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"layers must be comma-separated integers, got {text!r}") from None


class LogitLens:
    """The plugin: arguments left None come from the ENGINE_LOGIT_LENS_* variables; no layers: every
    layer. Logits come from the engine's own final norm and lm_head (TapRows.model)."""

    def __init__(
        self,
        layers: tuple[int, ...] | None = None,
        top_k: int | None = None,
        file: str | None = None,
    ) -> None:
        self.layers = tuple(layers or parse_layers(envvars.read("ENGINE_LOGIT_LENS_LAYERS")))
        self.top_k = top_k or int(envvars.read("ENGINE_LOGIT_LENS_TOP_K"))
        self.file = file if file is not None else envvars.read("ENGINE_LOGIT_LENS_FILE")
        if self.top_k < 1:
            raise ValueError(f"logit_lens: top_k must be >= 1, got {self.top_k}")
        self._lock = threading.Lock()  # engine_stats may run beside the serving thread
        self._prompt_len: dict[str, int] = {}
        # rid -> layer -> position -> (top ids, top probabilities)
        self._live: dict[str, dict[int, dict[int, tuple[list[int], list[float]]]]] = {}
        self._done: OrderedDict[str, dict] = OrderedDict()

    @hookimpl
    def engine_layer_taps(self, num_layers: int) -> list[LayerTap]:
        layers = self.layers or tuple(range(num_layers))
        return [LayerTap(name=TAP_NAME, layers=layers, fn=self.on_rows)]

    @hookimpl
    def engine_request_arrived(self, req) -> None:
        with self._lock:
            self._prompt_len[req.rid] = len(req.input_ids)

    def on_rows(self, rows: TapRows) -> None:
        """The rows that predict a generated token (position >= prompt length - 1; a beam search's
        rows are left out) through the head; their top-k kept by request, layer and position."""
        with self._lock:
            pick = [
                i
                for i, (rid, pos, beam) in enumerate(zip(rows.rids, rows.positions, rows.beams))
                if beam is None and pos >= self._prompt_len.get(rid, 0) - 1
            ]
        if not pick:
            return
        import torch

        with torch.inference_mode():
            logits = rows.model.logits(rows.values[pick].contiguous(), None)
            top = torch.softmax(logits.float(), dim=-1).topk(self.top_k, dim=-1)
        ids, probs = top.indices.tolist(), top.values.tolist()
        with self._lock:
            for j, i in enumerate(pick):
                by_layer = self._live.setdefault(rows.rids[i], {}).setdefault(rows.layer, {})
                by_layer[rows.positions[i]] = (ids[j], [round(p, 6) for p in probs[j]])

    @hookimpl
    def engine_request_finished(self, req) -> None:
        with self._lock:
            prompt_len = self._prompt_len.pop(req.rid, 0)
            live = self._live.pop(req.rid, None)
            if live is None:
                return
            record = _record(req.rid, prompt_len, live)
            self._done[req.rid] = record
            while len(self._done) > KEEP:
                self._done.popitem(last=False)
        if self.file:
            with open(self.file, "a") as f:
                f.write(json.dumps(record) + "\n")

    @hookimpl
    def engine_stats(self, role: str) -> dict | None:
        if role != "scheduler":
            return None
        with self._lock:
            return {"requests": dict(self._done)}


def _record(rid: str, prompt_len: int, live: dict) -> dict:
    """{"rid", "prompt_tokens", "positions": [...], "layers": {"<layer>": {"top_ids": [[k] per
    position], "top_probs": [[k] per position]}}}: positions every layer has, ascending."""
    positions = sorted(set.intersection(*(set(by_pos) for by_pos in live.values())))
    layers = {
        str(layer): {
            "top_ids": [by_pos[p][0] for p in positions],
            "top_probs": [by_pos[p][1] for p in positions],
        }
        for layer, by_pos in sorted(live.items())
    }
    return {"rid": rid, "prompt_tokens": prompt_len, "positions": positions, "layers": layers}


def table(record: dict, tokenizer) -> str:
    """One line per layer, one column per predicted token: each layer's top-1 guess, decoded."""
    lines = []
    for layer, top in record["layers"].items():
        cells = [repr(tokenizer.decode([ids[0]]))[1:-1][:10].ljust(10) for ids in top["top_ids"]]
        lines.append(f"layer {layer:>3}  " + " ".join(cells))
    return "\n".join(lines)
