"""One beam search's selection rules, step by step: transformers' beam search, whose output is the reference.

Per step, over the K live beams' processed log-probabilities [K, V]:
  1. every continuation's cumulative score: beam score + token log-probability (K x V candidates);
  2. the best `keep` = max(2, 1 + number of stop tokens) x K of them (at most all K x V): one top-k;
  3. a candidate "hits" when its token is a stop token or the hypothesis reached max_new_tokens;
  4. the K best candidates that do not hit become the live beams (scores of those that hit are pushed
     down by 1e9, so fewer than K non-hitting candidates leave hopeless beams, as in transformers);
  5. hitting candidates among the first K join the finished hypotheses with score
     cumulative log-probability / generated length ** length_penalty, and the K best finished are kept.
The search ends when no live beam can beat the worst finished hypothesis (early_stopping False: judged
at the current length; "never": at max_new_tokens when length_penalty > 0), when K hypotheses are
finished and early_stopping is True, or when every candidate hits.

All of it is tensor operations on the scheduler's device; nothing here loops over beams or tokens. Only
the 2K candidates chosen (K live beams, K finished) get a copy of their tokens, so a step's memory does not
grow with the stop tokens times max_new_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PUSH_DOWN = -1.0e9  # transformers' constant: added to scores that must not be chosen


@dataclass
class Hypothesis:
    output_ids: list[int]
    logprob: float  # cumulative log-probability (after the logit processors), as in beam scores
    score: float  # logprob / len(output_ids) ** length_penalty
    stopped: bool  # its last token is a stop token (else it reached max_new_tokens)
    slot: int = 0  # its index among the finished hypotheses (BeamStates keeps rows by it)


class BeamSelection:
    """The state of one beam search: live beams' scores and tokens, the finished hypotheses so far."""

    def __init__(
        self,
        width: int,
        max_new_tokens: int,
        stop_ids: tuple[int, ...],
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        device="cpu",
    ) -> None:
        k = width
        self.width = k
        self.max_new = max_new_tokens
        self.length_penalty = float(length_penalty)
        self.early_stopping = early_stopping
        self.keep = max(2, 1 + len(stop_ids)) * k
        self.stop_ids = torch.tensor(stop_ids, dtype=torch.int64, device=device)
        self.scores = torch.zeros(k, dtype=torch.float32, device=device)
        # at the start every beam is the prompt: only the first one counts
        self.scores[1:] = PUSH_DOWN
        self.tokens = torch.full((k, max_new_tokens), -1, dtype=torch.int64, device=device)
        self.fin_scores = torch.full((k,), PUSH_DOWN, dtype=torch.float32, device=device)
        self.fin_logprobs = torch.zeros(k, dtype=torch.float32, device=device)
        self.fin_tokens = torch.full((k, max_new_tokens), -1, dtype=torch.int64, device=device)
        self.fin_lens = torch.zeros(k, dtype=torch.int64, device=device)
        self.is_fin = torch.zeros(k, dtype=torch.bool, device=device)
        self.improvable = True
        self.steps = 0  # tokens generated so far by every live beam
        self.done = False
        # the last step's (kept, best, candidates' parents, live parents), for row_sources
        self._sources: tuple[torch.Tensor, ...] = ()

    def _tokens_of(self, parents: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """[n, max_new] the token rows of n candidates: their parent's tokens, then their own."""
        rows = self.tokens[parents]
        rows[:, self.steps] = tokens
        return rows

    def step(self, logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Processed log-probabilities [K, V] of the live beams (or [1, V] at the start, the prompt's)
        -> (parent beam [K], chosen token [K]) of the next live beams."""
        k, t = self.width, self.steps
        top_scores, parents, tokens = self._best_candidates(logprobs)
        hits = (
            torch.isin(tokens, self.stop_ids)
            if self.stop_ids.numel()
            else torch.zeros_like(tokens, dtype=torch.bool)
        )
        if t + 1 >= self.max_new:
            hits = torch.ones_like(hits)
        # the next live beams: the best candidates that did not hit
        running = top_scores + hits.to(torch.float32) * PUSH_DOWN
        nxt = torch.topk(running, k).indices
        # finished hypotheses: hitting candidates among the first K, if they can still count
        just = hits & (torch.arange(hits.numel(), device=hits.device) < k)
        norm = top_scores / ((t + 1) ** self.length_penalty)
        if bool(self.is_fin.all()) and self.early_stopping is True:
            norm = norm + PUSH_DOWN
        if not self.improvable:
            norm = norm + PUSH_DOWN
        norm = norm + (~just).to(torch.float32) * PUSH_DOWN
        merged = torch.cat([self.fin_scores, norm])
        best = torch.topk(merged, k).indices
        kept = best < k  # a finished hypothesis kept, else candidate best - k
        cand = (best - k).clamp(min=0)
        cand_parents, live = parents[cand], parents[nxt]
        new_rows = self._tokens_of(cand_parents, tokens[cand])
        self.fin_tokens = torch.where(
            kept[:, None], self.fin_tokens[best.clamp(max=k - 1)], new_rows
        )
        self.tokens, self.scores = self._tokens_of(live, tokens[nxt]), running[nxt]
        self.fin_scores = merged[best]
        self.fin_logprobs = torch.cat([self.fin_logprobs, top_scores])[best]
        self.fin_lens = torch.cat([self.fin_lens, torch.full_like(tokens, t + 1)])[best]
        self.is_fin = torch.cat([self.is_fin, just])[best]
        self.steps = t = t + 1
        # can a live beam still beat the worst finished hypothesis?
        never_long = self.early_stopping == "never" and self.length_penalty > 0.0
        best_len = self.max_new if never_long else t
        best_possible = self.scores[0] / (best_len**self.length_penalty)
        worst = torch.where(
            self.is_fin, self.fin_scores.min(), torch.tensor(PUSH_DOWN, device=merged.device)
        )
        self.improvable = self.improvable and bool((best_possible > worst).any())
        all_finished = bool(self.is_fin.all()) and self.early_stopping is True
        self.done = not self.improvable or all_finished or bool(hits.all())
        self._sources = (kept, best, cand_parents, live)
        return live, tokens[nxt]

    def row_sources(self) -> torch.Tensor:
        """[2K] after a step: where each finished slot's and each live beam's history comes from, as an
        index into the histories before the step (finished slots 0..K-1, then live beams K..2K-1)."""
        kept, best, cand_parents, live = self._sources
        k = self.width
        return torch.cat([torch.where(kept, best, cand_parents + k), live + k])

    def _best_candidates(
        self, logprobs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The `keep` best (cumulative score, parent beam, token) over all K x V continuations, best
        first. Two top-k's (per beam, then over the K x keep survivors) give the same candidates as
        one over K x V, for less work on wide beams."""
        k, vocab = self.width, logprobs.shape[1]
        # a stop list as long as the vocabulary asks for more than there are
        keep = min(self.keep, k * vocab)
        # the start: every beam is the prompt, beam 0 alone counts
        if logprobs.shape[0] == 1 and k > 1:
            # ...unless its keep-th best is below the other beams' pushed-down best
            if keep <= vocab:
                top_scores, tokens = torch.topk(logprobs[0] + self.scores[0], keep)
                if bool(top_scores[-1] > logprobs[0].max() + self.scores[1]):
                    return top_scores, torch.zeros_like(tokens), tokens
            logprobs = logprobs.expand(k, -1)
        total = logprobs + self.scores[:, None]
        if keep >= vocab:
            top_scores, index = torch.topk(total.reshape(-1), keep)
            return top_scores, index // vocab, index % vocab
        row_scores, row_tokens = torch.topk(total, keep, dim=1)  # [K, keep]
        top_scores, index = torch.topk(row_scores.reshape(-1), keep)
        # a tie at the cut: one top-k decides, as transformers'
        if bool((row_scores[:, -1] == top_scores[-1]).any()):
            top_scores, index = torch.topk(total.reshape(-1), keep)
            return top_scores, index // vocab, index % vocab
        return top_scores, index // keep, row_tokens.reshape(-1)[index]

    def results(self, count: int) -> list[Hypothesis]:
        """The `count` best finished hypotheses, best first; fewer when fewer finished (a grammar with
        fewer token paths than beams). A slot never filled holds a placeholder, or a candidate that did
        not finish at a pushed-down score (-1e9 plus a log-probability rounds to -1e9 in float32); a
        finished one from a pushed-down beam (the prompt's copies, at a start a grammar narrows to fewer
        tokens than beams) is no hypothesis either."""
        kept = self.is_fin[:count] & (self.fin_logprobs[:count] > PUSH_DOWN / 2)
        slots = kept.nonzero().flatten().tolist()
        scores, logprobs = (
            self.fin_scores[:count][kept].tolist(),
            self.fin_logprobs[:count][kept].tolist(),
        )
        lens, tokens = self.fin_lens[:count][kept].tolist(), self.fin_tokens[:count][kept].tolist()
        stops = set(self.stop_ids.tolist())
        out = []
        for ids, n, lp, score, slot in zip(tokens, lens, logprobs, scores, slots):
            ids = ids[:n]
            out.append(Hypothesis(ids, lp, score, bool(ids) and ids[-1] in stops, slot))
        return out
