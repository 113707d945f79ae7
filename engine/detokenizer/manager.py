"""DetokenizerManager: receive token outputs, decode them as a batch, send text to the tokenizer manager."""

from __future__ import annotations

import sys

import msgspec
import zmq

from engine.detokenizer.incremental import IncrementalDetokenizer
from engine.ipc.channels import pull_socket, push_socket
from engine.ipc.messages import BatchTextOut, BatchTokenOut, Codec, ToDetokenizer, ToTokenizer
from engine.tokenizer import BatchDecoder


class DetokenizerManager:
    def __init__(self, model_dir: str, endpoints: dict) -> None:
        self.incremental = IncrementalDetokenizer(BatchDecoder(model_dir))
        self.zmq_ctx = zmq.Context(1)
        self.recv_sock = pull_socket(self.zmq_ctx, endpoints["detokenizer"])
        self.send_sock = push_socket(self.zmq_ctx, endpoints["tokenizer"])
        self.recv_codec = Codec(ToDetokenizer)
        self.send_codec = Codec(ToTokenizer)
        self.info: dict = {}

    def serve_forever(self) -> None:
        while True:
            try:
                message = self.recv_codec.decode(self.recv_sock.recv())
            except msgspec.DecodeError as exc:  # not ours: drop it rather than die
                print(f"engine::detokenizer: dropped a malformed message ({exc})", file=sys.stderr)
                continue
            if isinstance(message, BatchTokenOut):
                message = self.detokenize(message)
            self.send_sock.send(self.send_codec.encode(message))

    def detokenize(self, out: BatchTokenOut) -> BatchTextOut:
        """The detokenize stage: one batch decode for every request in the message."""
        finished = [f is not None for f in out.finished]
        deltas = self.incremental.step(out.rids, [[t] if t >= 0 else [] for t in out.token_ids], finished)
        return BatchTextOut(out.rids, deltas, out.token_ids, out.finished, out.meta)
