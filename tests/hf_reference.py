"""transformers references for layer taps: hidden states at a layer's points, and greedy generate with a
steering hook, on the float32 HF model of conftest's hf_model fixture."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from conftest import hf_greedy, hf_greedy_checked


@contextmanager
def one_thread():
    """torch on one thread while the references run: with the engine's processes busy beside it, two
    threads spend far longer waiting on each other than one takes alone."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _first(output):
    """A module's main output: decoder layers and attention return a tuple in some transformers versions."""
    return output[0] if isinstance(output, tuple) else output


def hf_pass(
    model, ids: list[int], layers: list[int], point: str = "resid_post", after_hooks: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """One unpadded forward over ids: ([len(layers), len(ids), hidden] float32, the point's value at
    every position; [len(ids), vocab] logits). resid_post comes from output_hidden_states
    (hidden_states[i + 1]), except for the last layer, whose entry there has the final norm applied:
    that one from a hook on the layer. output_hidden_states holds a layer's output before forward
    hooks change it: after_hooks reads every layer from a hook of its own, run after the others
    (steered's)."""
    inner = model.model
    last = len(inner.layers) - 1
    captured: dict[int, torch.Tensor] = {}

    def keep(i: int):
        def hook(module, args, output) -> None:
            captured[i] = _first(output)[0].detach().clone()

        return hook

    handles = []
    for i in layers:
        if point == "resid_post" and i != last and not after_hooks:
            continue
        module = {
            "resid_post": inner.layers[i],
            "attn_out": inner.layers[i].self_attn,
            "mlp_out": inner.layers[i].mlp,
        }[point]
        handles.append(module.register_forward_hook(keep(i)))
    try:
        with torch.inference_mode():
            out = model(torch.tensor([ids]), output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()
    rows = []
    for i in layers:
        if point == "resid_post" and i != last and not after_hooks:
            rows.append(out.hidden_states[i + 1][0])
        else:
            rows.append(captured[i])
    return torch.stack(rows).float(), out.logits[0]


def hf_states(
    model, ids: list[int], layers: list[int], point: str = "resid_post", after_hooks: bool = False
) -> torch.Tensor:
    """hf_pass's states alone."""
    return hf_pass(model, ids, layers, point, after_hooks)[0]


def greedy_in_pass(logits: torch.Tensor, prompt_len: int, tokens: list[int], margin=1e-3) -> bool:
    """Whether tokens, generated after prompt_len prompt tokens, are the argmax at every position of
    one pass's logits, ahead of the runner-up by margin (conftest.hf_greedy_checked's test)."""
    top2 = logits[prompt_len - 1 : prompt_len - 1 + len(tokens)].topk(2, dim=-1)
    return top2.indices[:, 0].tolist() == tokens and bool(
        (top2.values[:, 0] - top2.values[:, 1] >= margin).all()
    )


@contextmanager
def steered(model, steps: list[tuple[int, torch.Tensor, float]]):
    """Forward hooks adding scale * vector to each listed decoder layer's output, at every position."""
    handles = []
    for layer, vector, scale in steps:

        def hook(module, args, output, vector=vector, scale=scale):
            if isinstance(output, tuple):
                return (output[0] + scale * vector,) + tuple(output[1:])
            return output + scale * vector

        handles.append(model.model.layers[layer].register_forward_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def hf_steered_greedy(
    model,
    ids: list[int],
    steps: list[tuple[int, torch.Tensor, float]],
    max_new_tokens: int,
    candidate: list[int] | None = None,
) -> list[int]:
    """transformers' greedy generate with the steering hooks installed; given a candidate (the engine's
    tokens), found by checking it in one hooked pass first (conftest.hf_greedy_checked)."""
    with steered(model, steps):
        if candidate is None:
            return hf_greedy(model, ids, max_new_tokens)
        return hf_greedy_checked(model, ids, candidate, max_new_tokens)


def row_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest error of one row (a layer's state at one position), relative to that row's norm.
    Not an absolute bound: SmolLM2's residual stream holds values near 2.5e4, where float32's spacing is
    2e-3; transformers in float32 is itself that far from float64 there."""
    assert tuple(ours.shape) == tuple(ref.shape), (tuple(ours.shape), tuple(ref.shape))
    ours, ref = ours.double(), ref.double()
    return float(((ours - ref).norm(dim=-1) / ref.norm(dim=-1).clamp(min=1e-12)).max())
