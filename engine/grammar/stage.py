"""The scheduler's grammars: compiled off the step loop, one bitmask fill and one in-place mask per
step for all constrained rows, each row's matcher advanced by its token.

A request with a constraint waits in the queue until its grammar is compiled (a worker thread; a
constraint seen before is ready at once), without holding back the requests behind it. Its matcher
is created when it is admitted, lives on the request (so a retracted request resumes where it was),
and for a beam search is forked per beam.
"""

from __future__ import annotations

import collections
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from engine import hooks
from engine.hooks import FatalHookError
from engine.grammar.backend import GrammarBackend, Matcher, XGrammarBackend
from engine.grammar.constraints import KINDS


MAX_COMPILED = 256  # distinct constraints kept compiled (least recently used dropped first)


def constraint_of(sampling) -> tuple[str, str] | None:
    for kind in KINDS:
        text = getattr(sampling, kind)
        if text is not None:
            return kind, text
    return None


class Grammars:
    def __init__(self, model_dir: str, vocab_size: int, stop_ids: list[int]) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.stop_ids = stop_ids
        self._backend: GrammarBackend | None = None
        # making the backend failed: kept, not retried
        self._backend_error: BaseException | None = None
        self._pool: ThreadPoolExecutor | None = None
        # LRU
        self._compiled: collections.OrderedDict[tuple[str, str], Future] = collections.OrderedDict()
        self._queued: list[
            tuple[tuple[str, str], Future]
        ] = []  # compiles submitted, until done or cancelled
        self._bitmask: torch.Tensor | None = None
        self._broken: dict[
            int, str
        ] = {}  # id(matcher) -> why the backend failed on its row in this step's mask
        # the last compiles
        self.compile_seconds: collections.deque[float] = collections.deque(maxlen=MAX_COMPILED)
        self.mask_seconds = 0.0  # fill + apply, since start
        self.mask_steps = 0

    # ------------------------------------------------------------------ compile (worker thread)

    def backend(self) -> GrammarBackend:
        """Made once: a failure (the plugin's hook, the tokenizer) is kept and fails every constrained
        request with the same error, instead of calling the hook again for each."""
        if self._backend is None:
            if self._backend_error is not None:
                raise self._backend_error
            try:
                self._backend = self._make_backend()
            except BaseException as exc:
                self._backend_error = exc
                raise
        return self._backend

    def _make_backend(self) -> GrammarBackend:
        from engine.tokenizer import load_hf_tokenizer

        tokenizer = load_hf_tokenizer(self.model_dir)
        found = (
            hooks.call(
                "engine_grammar_backend",
                tokenizer=tokenizer,
                vocab_size=self.vocab_size,
                stop_ids=list(self.stop_ids),
            )
            if hooks.has("engine_grammar_backend")
            else None
        )
        return found or XGrammarBackend(tokenizer, self.vocab_size, list(self.stop_ids))

    def _compile(self, kind: str, text: str) -> Any:
        start = time.perf_counter()
        compiled = self.backend().compile(kind, text)
        self.compile_seconds.append(time.perf_counter() - start)
        return compiled

    def request(self, kind: str, text: str) -> Future:
        """The compiled grammar of a constraint, as a future (one compile per distinct constraint)."""
        key = (kind, text)
        future = self._compiled.get(key)
        if future is None:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-grammar")
            future = self._compiled[key] = self._pool.submit(self._compile, kind, text)
            self._queued.append((key, future))
            # a client sending ever new schemas must not grow memory
            if len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)  # requests holding its future keep it
        else:
            self._compiled.move_to_end(key)
        return future

    def sweep(self, waiting: list) -> int:
        """Cancel the queued compiles no waiting request holds (theirs were aborted or failed while they
        waited, or the constraint fell out of the cache): one compile thread would run each of them
        before any constraint sent after them. Called once a batch of arrivals is queued; returns how
        many it cancelled. A cancelled constraint sent again compiles again."""
        held = {id(r.grammar) for r in waiting if r.grammar is not None}
        kept, cancelled = [], 0
        for key, future in self._queued:
            if future.done():
                continue
            # False once it runs: it then ends as it will
            if id(future) not in held and future.cancel():
                if self._compiled.get(key) is future:
                    del self._compiled[key]
                cancelled += 1
            else:
                kept.append((key, future))
        self._queued = kept
        return cancelled

    @staticmethod
    def problem(future: Future, kind: str) -> str | None:
        """Why a finished compile cannot serve (the request then fails alone). A fatal plugin error
        (ENGINE_PLUGIN_ERRORS=raise) happened in the compile thread: raised here, in the serving
        thread, it stops the process as it would anywhere else."""
        exc = future.exception()
        if isinstance(exc, FatalHookError):
            raise exc
        return (
            None
            if exc is None
            else f"{kind}: the grammar could not be compiled: {type(exc).__name__}: {exc}"
        )

    def matcher(self, future: Future) -> Matcher:
        return self.backend().matcher(future.result())

    # ------------------------------------------------------------------ each step

    def mask(
        self, logits: torch.Tensor, matchers: list, failed: dict[int, str] | None = None
    ) -> None:
        """Every constrained row's disallowed tokens to -inf, in place: one fill, one apply. Where the
        backend raises, the rows it fails on are found one by one and the others masked: an ordinary
        row then fails in accept(), which it passes through next; beam rows (accept() never sees them)
        go into `failed` (row -> why), which fails their search alone, unmasked rows and all."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        start = time.perf_counter()
        backend = self.backend()
        n = logits.shape[0]
        if self._bitmask is None or self._bitmask.shape[0] < n:
            self._bitmask = backend.new_bitmask(max(n, 64))
        bitmask = self._bitmask[:n]
        if failed is None:  # the ordinary rows' mask of this step: what accept() reads next
            self._broken = {}
        try:
            backend.fill_masks([matchers[i] for i in rows], bitmask, rows)
            backend.apply_masks(logits, bitmask, rows)
        except FatalHookError:
            raise
        except Exception:  # noqa: BLE001 - a plugin's backend: found row by row, the others masked
            for i in rows:
                try:
                    backend.fill_masks([matchers[i]], bitmask, [i])
                    backend.apply_masks(logits, bitmask, [i])
                except FatalHookError:
                    raise
                except Exception as exc:  # noqa: BLE001 - this row fails (its search, or in accept)
                    if failed is None:
                        self._broken[id(matchers[i])] = _backend_failed(backend, exc)
                    else:
                        failed[i] = _backend_failed(backend, exc)
        self.mask_seconds += time.perf_counter() - start
        self.mask_steps += 1

    def accept(self, matchers: list, tokens: list[int]) -> dict[int, str]:
        """Advance each constrained row by its token; rows whose grammar refuses it (or whose backend
        failed on it, in this step's mask or here), with why."""
        failed: dict[int, str] = {}
        broken, self._broken = self._broken, {}
        for i, (m, t) in enumerate(zip(matchers, tokens)):
            if m is None:
                continue
            if id(m) in broken:
                failed[i] = broken[id(m)]
                continue
            try:
                if t >= 0 and not m.is_terminated() and not m.accept_token(t):
                    failed[i] = f"the grammar does not allow token {t} here"
            except FatalHookError:
                raise
            except Exception as exc:  # noqa: BLE001 - a plugin's matcher: this row alone
                failed[i] = _backend_failed(self._backend, exc)
        return failed

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _backend_failed(backend, exc: BaseException) -> str:
    name = getattr(backend, "name", type(backend).__name__)
    return f"the grammar backend {name!r} failed: {type(exc).__name__}: {exc}"
