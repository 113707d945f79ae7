"""Wire safety (typed msgspec codecs, never pickle) and packaging facts."""

from __future__ import annotations

import pickle
import subprocess
import sys

import msgspec
import pytest

from engine.ipc.messages import (
    BatchTokenOut,
    Codec,
    FinishReason,
    GenerateBatch,
    StatsRequest,
    ToDetokenizer,
    ToScheduler,
    TokenizedRequest,
)
from engine.sampling_params import SamplingParams


def test_round_trip_and_type_checking():
    codec = Codec(ToScheduler)
    message = GenerateBatch([TokenizedRequest("r1", [1, 2, 3], SamplingParams(max_new_tokens=5, temperature=0.0))])
    assert codec.decode(codec.encode(message)) == message
    assert codec.decode(codec.encode(StatsRequest("x"))) == StatsRequest("x")
    # a message meant for another channel does not decode here
    other = Codec(ToDetokenizer).encode(BatchTokenOut(["r"], [1], [FinishReason("length", length=1)], [None]))
    with pytest.raises(msgspec.ValidationError):
        codec.decode(other)


def test_pickle_payload_is_rejected_not_executed():
    class Boom:
        def __reduce__(self):
            return (print, ("pwned",))

    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        Codec(ToScheduler).decode(pickle.dumps(Boom()))


def test_no_pickle_in_engine_sources():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for path in list((root / "engine").rglob("*.py")) + list((root / "kernels").rglob("*.py")):
        text = path.read_text()
        for banned in ("send_pyobj", "recv_pyobj", "import pickle", "pickle.loads"):
            assert banned not in text, f"{path.name} uses {banned}"


def test_transformers_does_not_take_our_kernels_package():
    code = "from transformers.utils.import_utils import is_kernels_available; print(is_kernels_available())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_user_process_does_not_need_torch_to_import_engine():
    code = "import sys, engine; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
