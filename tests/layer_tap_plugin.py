"""A plugin for tests/test_layer_taps.py: layer taps that record, raise and write.

- "record" reads resid_post at layers 3 and 20 and saves each call's rows (torch.save) under the
  directory named by LAYER_TAP_DIR;
- "boom" raises on any step that holds a request whose rid starts "tapboom-";
- "add" (writes=True) adds the vector registered as "unit" to resid_post at layer 10, as steering
  with that vector does;
- every step's forward records whether it carried a tap plan (ENGINE forward hook).
"""

from __future__ import annotations

import itertools
import os
import sys

import torch

from engine.hooks import hookimpl
from engine.taps import LayerTap, TapRows

HIDDEN = 576
_calls = itertools.count()


def unit_vector() -> list[float]:
    g = torch.Generator().manual_seed(7)
    return (torch.randn(HIDDEN, generator=g) * 2.0).tolist()


def _record(rows: TapRows) -> None:
    out = os.environ.get("LAYER_TAP_DIR")
    if out:
        torch.save(
            {
                "layer": rows.layer,
                "point": rows.point,
                "values": rows.values.clone(),
                "rids": list(rows.rids),
                "positions": list(rows.positions),
                "beams": list(rows.beams),
                "mode": rows.mode,
            },
            os.path.join(out, f"{os.getpid()}-{next(_calls):06d}.pt"),
        )


def _boom(rows: TapRows) -> None:
    if any(r.startswith("tapboom-") for r in rows.rids):
        raise RuntimeError("the probe broke")


def _add(rows: TapRows) -> None:
    rows.values += torch.tensor(unit_vector(), dtype=rows.values.dtype)


@hookimpl
def engine_layer_taps():
    return [
        LayerTap("record", (3, -10), _record),
        LayerTap("boom", (5,), _boom),
        LayerTap("add", (10,), _add, writes=True),
    ]


@hookimpl
def engine_steering_vectors():
    return {"unit": unit_vector()}


@hookimpl
def engine_forward_before(batch, rids):
    out = os.environ.get("LAYER_TAP_DIR")
    if out:
        with open(os.path.join(out, "steps.log"), "a") as f:
            f.write(f"{int(batch.taps is not None)} {' '.join(rids)}\n")


plugin = sys.modules[__name__]
