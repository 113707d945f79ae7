"""The scheduler's live beam searches: each is one request whose K beams are decode rows, forwarded in
the same step as the ordinary requests' rows.

Memory: every beam has a row of req_to_token (a slot). The prompt's K/V is computed once and put in
the prefix cache; each beam's row starts with the same prompt indices. A decode step gives each beam
one new pool token. When a beam continues another, its row's generated part is overwritten with the
parent's indices (index rows are copied, never K/V), so branches share their common prefix. A beam
search holds its prompt plus K tokens per decode step at most (`params.kv_tokens_needed`): tokens of
branches that died stay allocated until the search ends, when all of them go back to the pool.

Rows of all beam searches sit in one set of tensors (slots, lengths, last tokens, sampling state), in
group order, beam 0 first; they change when a search starts, ends, or its beams are reordered.
"""

from __future__ import annotations

import torch

from engine import hooks
from engine.hooks import FatalHookError
from engine.beam_search.hidden import BeamStates, wants_rows
from engine.beam_search.selection import PUSH_DOWN, BeamSelection
from engine.sampling.batch_params import SamplingTensors
from engine.sampling.processors import ProcessorSet
from engine.sampling.sampler import process_logits
from engine.scheduler.batch import stop_table
from engine.scheduler.request import Req


class BeamGroup:
    """One beam search in the scheduler."""

    __slots__ = ("req", "selection", "slots", "owned", "matchers", "failed", "hidden")

    def __init__(self, req: Req, selection: BeamSelection, slots: torch.Tensor) -> None:
        self.req = req
        self.selection = selection
        # [K] int64: beam i's row of req_to_token (beam 0's is the request's own)
        self.slots = slots
        self.owned: list[
            torch.Tensor
        ] = []  # pool indices of generated tokens, all freed at the end
        self.matchers: list = [
            None
        ] * selection.width  # each beam's grammar matcher (structured output)
        # why its grammar backend failed advancing its matchers: it ends
        self.failed: str | None = None
        # each beam's generated hidden states, when it asked for them
        self.hidden: BeamStates | None = None

    @property
    def width(self) -> int:
        return self.selection.width

    def remaining_tokens(self) -> int:
        """Pool tokens this search may still take: one per beam per decode step left (after s
        selections, s - 1 of its max_new - 1 decode steps have run)."""
        return self.width * max(self.selection.max_new - self.selection.steps, 0)


def start_sampling(reqs: list[Req], copies: int, vocab_size: int, device) -> SamplingTensors:
    """Sampling state for `copies` rows of each request (penalties see the prompt)."""
    params = [r.sampling for r in reqs for _ in range(copies)]
    prompts = [r.input_ids for r in reqs for _ in range(copies)]
    n = len(params)
    return SamplingTensors.build(
        params, vocab_size, device, prompts, [[] for _ in range(n)], [(False, 0)] * n
    )


def advance_matchers(
    matchers: list, parents: list[int], tokens: list[int], selection: BeamSelection
) -> list:
    """Each next beam's grammar matcher: its parent's, forked, advanced by its token. A beam that can
    never win keeps its parent's state: one at -inf (its token was never allowed, or the grammar refuses
    it: a hook after the mask put it back, and the beam drops out) and one pushed down
    (fewer continuations than beams that are not stop tokens: it carries a stop token, which would
    terminate its matcher, and a terminated matcher has no next mask). A pushed-down beam is made -inf
    too: its continuations, from the state before its stop token, would make hypotheses with a stop
    token inside, which could fill the results of a grammar with fewer answers than asked for."""
    scores = selection.scores.tolist()
    out = []
    for j, (parent, token, score) in enumerate(zip(parents, tokens, scores)):
        m = matchers[parent].fork()
        if score > PUSH_DOWN / 2 and not m.is_terminated():
            # a hook after the mask put back a token the grammar refuses
            if not m.accept_token(token):
                selection.scores[j] = float("-inf")
        elif score != float("-inf"):
            selection.scores[j] = float("-inf")
        out.append(m)
    return out


def _advance_group(g: BeamGroup, matchers: list, parents: list[int], tokens: list[int]) -> None:
    """advance_matchers for one search; a plugin's backend raising (fork, accept_token) fails this search
    alone (g.failed), not the step's other requests."""
    try:
        g.matchers = advance_matchers(matchers, parents, tokens, g.selection)
    except FatalHookError:
        raise
    except Exception as exc:  # noqa: BLE001 - a plugin's matcher: this search alone
        g.failed = f"the grammar backend failed: {type(exc).__name__}: {exc}"


def selection_failed(exc: Exception) -> str:
    """Why a search whose selection raised ends (that search alone: the step's other rows go on)."""
    return f"beam selection failed: {type(exc).__name__}: {exc}"


def beam_step_hook(g: BeamGroup, parents: torch.Tensor, tokens: torch.Tensor) -> None:
    """engine_beam_step, after a selection (a HookError fails this search only)."""
    s = g.selection
    hooks.call(
        "engine_beam_step",
        rid=g.req.rid,
        step=s.steps,
        parents=parents.tolist(),
        tokens=tokens.tolist(),
        scores=s.scores.tolist(),
        finished=int(s.is_fin.sum()),
    )


class BeamBatch:
    def __init__(self, vocab_size: int, device, table: torch.Tensor) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.table = table  # req_to_token
        self.groups: list[BeamGroup] = []
        self.kv_tokens = 0  # pool tokens the live searches' generated beams hold
        self.kv_peak_tokens = 0
        self._set_rows([])

    def _set_rows(self, groups: list[BeamGroup], tensors: dict | None = None) -> None:
        self.groups = groups
        self.reqs = [g.req for g in groups for _ in range(g.width)]  # per row, for hooks
        self.beam_index = [i for g in groups for i in range(g.width)]
        # structured output: each beam's own
        self.matchers = [m for g in groups for m in g.matchers]
        self.any_grammar = any(m is not None for m in self.matchers)
        if tensors is None:
            empty = torch.zeros(0, dtype=torch.int64, device=self.device)
            tensors = dict(
                slots=empty,
                kv_lens=empty,
                last_ids=empty,
                out_lens=empty,
                stop_table=stop_table([], 1, self.device),
                sampling=start_sampling([], 1, self.vocab_size, self.device),
            )
        for name, value in tensors.items():
            setattr(self, name, value)

    @property
    def num_rows(self) -> int:
        return len(self.reqs)

    def __bool__(self) -> bool:
        return bool(self.groups)

    def remaining_tokens(self) -> int:
        return sum(g.remaining_tokens() for g in self.groups)

    # ------------------------------------------------------------------ a search starts

    def start(self, req: Req, selection: BeamSelection, first_tokens: torch.Tensor) -> BeamGroup:
        """After the prompt's prefill (its K/V cached and locked for the request) and the first
        selection: K rows that all begin with the prompt's indices (and the request's grammar state)."""
        n = req.prompt_len
        slots = torch.tensor([req.slot, *req.beam_slots], dtype=torch.int64, device=self.device)
        self.table[slots[1:], :n] = self.table[req.slot, :n]
        group = BeamGroup(req, selection, slots)
        if wants_rows(req.taps):
            group.hidden = BeamStates(selection, req.taps)
            group.hidden.select(selection, None)
        if req.matcher is not None:
            _advance_group(group, [req.matcher], [0] * group.width, first_tokens.tolist())
        k = group.width
        sampling = start_sampling([req], k, self.vocab_size, self.device)
        sampling.record(first_tokens)
        new = dict(
            slots=slots,
            kv_lens=torch.full((k,), n, dtype=torch.int64, device=self.device),
            last_ids=first_tokens,
            out_lens=torch.ones(k, dtype=torch.int64, device=self.device),
            stop_table=stop_table([req], k, self.device),
            sampling=sampling,
        )
        if not self.groups:
            self._set_rows([group], new)
            return group
        tensors = {
            name: torch.cat([getattr(self, name), value])
            for name, value in new.items()
            if name not in ("stop_table", "sampling")
        }
        tensors["stop_table"] = self.stop_table.cat(new["stop_table"])
        tensors["sampling"] = self.sampling.merge(sampling)
        self._set_rows(self.groups + [group], tensors)
        return group

    # ------------------------------------------------------------------ decode

    def place(self, loc: torch.Tensor) -> torch.Tensor:
        """Give each beam row its next pool token (loc, one per row); returns the positions."""
        positions = self.kv_lens
        self.table[self.slots, positions] = loc
        self.kv_lens = positions + 1
        off = 0
        for g in self.groups:
            g.owned.append(loc[off : off + g.width])
            off += g.width
        self.kv_tokens += off
        self.kv_peak_tokens = max(self.kv_peak_tokens, self.kv_tokens)
        return positions

    # ------------------------------------------------------------------ sample

    def output_ids(self) -> list[list[int]]:
        """Each row's generated tokens (for custom processors)."""
        out: list[list[int]] = []
        for g in self.groups:
            s = g.selection
            out += s.tokens[:, : s.steps].tolist()
        return out

    def process(
        self, logits: torch.Tensor, processors: ProcessorSet, failed: dict[int, str], grammars
    ) -> torch.Tensor:
        """Log-probabilities of every beam row, then the engine's processing on them (transformers'
        order for beam search: processors see log-probabilities), grammar masks last."""
        logprobs = torch.log_softmax(logits, dim=-1)
        ids = self.output_ids() if self.sampling.any_processor else []
        grammar = (
            (lambda lg: grammars.mask(lg, self.matchers, failed)) if self.any_grammar else None
        )  # noqa: E731
        return process_logits(
            logprobs,
            self.sampling,
            self.out_lens,
            self.stop_table,
            ids,
            processors,
            failed,
            self.beam_index,
            grammar,
        )

    def select(
        self, scores: torch.Tensor, failed: dict[int, str]
    ) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """One selection per search: (parent beam, token) of each next beam; None for a search whose
        selection raised, which goes into `failed` (id of its request -> why) to fail alone."""
        out: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        off = 0
        for g in self.groups:
            try:
                out.append(g.selection.step(scores[off : off + g.width]))
            except Exception as exc:  # noqa: BLE001 - this search alone
                failed[id(g.req)] = selection_failed(exc)
                out.append(None)
            off += g.width
        return out

    # ------------------------------------------------------------------ results

    def advance(self, choices: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Reorder each search's beams to their chosen parents and append the chosen tokens (a search
        whose grammar backend failed on its matchers is marked: `failed`, to end after)."""
        if not self.groups:
            return
        table, src, off = self.table, [], 0
        kv_lens = self.kv_lens.tolist()
        for g, (parents, _) in zip(self.groups, choices):
            start, end = g.req.prompt_len, kv_lens[off]
            if end > start:
                table[g.slots, start:end] = table[g.slots[parents], start:end]
            if g.hidden is not None and g.failed is None:  # this step's rows, from the layer taps
                g.failed = g.hidden.take_step(g.selection, g.req.taps)
            src.append(parents + off)
            off += g.width
        index = torch.cat(src)
        tokens = torch.cat([t for _, t in choices])
        if self.any_grammar:
            for g, (parents, chosen) in zip(self.groups, choices):
                if g.matchers[0] is not None:
                    _advance_group(g, g.matchers, parents.tolist(), chosen.tolist())
            self.matchers = [m for g in self.groups for m in g.matchers]
        self.last_ids = tokens
        self.out_lens = self.out_lens + 1
        if self.sampling.counts is not None:
            self.sampling = self.sampling.take(index, index.tolist())
        self.sampling.record(tokens)

    def remove(self, leaving: list[BeamGroup]) -> None:
        """Drop these searches' rows (finished, aborted or retracted)."""
        ids = {id(g) for g in leaving}
        keep_list = [id(g) not in ids for g in self.groups for _ in range(g.width)]
        groups = [g for g in self.groups if id(g) not in ids]
        if not groups:
            self._set_rows([])
            return
        keep = torch.tensor(keep_list, dtype=torch.bool, device=self.device)
        tensors = {
            name: getattr(self, name)[keep] for name in ("slots", "kv_lens", "last_ids", "out_lens")
        }
        tensors["stop_table"] = self.stop_table.filter(keep, sum(keep_list))
        tensors["sampling"] = self.sampling.filter(keep, keep_list)
        self._set_rows(groups, tensors)

    def release_tokens(self, g: BeamGroup) -> torch.Tensor:
        """Every pool index the search's beams took (for the pool's free list); the search holds none after."""
        owned, g.owned = g.owned, []
        self.kv_tokens -= sum(int(t.numel()) for t in owned)
        return torch.cat(owned) if owned else torch.zeros(0, dtype=torch.int64, device=self.device)
