"""Build the decoder from a Hugging Face directory (config.json + safetensors), reporting progress.

Weights are read with plain file reads straight into the tensors the model keeps: fused projections
(qkv, gate_up) get their parts read into their rows, nothing is concatenated afterwards. Only the token
embedding stays memory-mapped on the CPU (mapped_weight.py: it is gathered from, a few rows a token);
reading every weight through a mapping left every page of the file resident in the scheduler beside
the fused copies (1.1 GB for this 540 MB model). Weights packed at load come from mappings of the
file instead, one at a time, their pages given back once used (weight_views.py); weights converted to
another dtype are converted from a mapping too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from engine.model.config import ModelConfig, model_config_from_hf
from engine.linear.f32_blocks import exact_blocks
from engine.model.llama import LlamaForCausalLM, weight_plan
from engine.model.mapped_weight import MappedWeight, mappable
from engine.linear.f32_head import Float32Head
from engine.model.fused_decode import install_exact
from engine.linear.onednn import our_kernel_library, pack_linears, packing_available
from engine.linear.panel_cache import keep_panels, mapped_panels
from engine.model.rope import rotary_tables
from engine.model.safetensors_io import TensorEntry, index_file
from engine.model.weight_views import WeightViews
from engine.quantization import linear_shapes, load_stored, quantize_model


def safetensors_files(model_dir: str) -> list[Path]:
    folder = Path(model_dir)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {model_dir}")
    return files


def index_weights(model_dir: str) -> dict[str, TensorEntry]:
    """Where each tensor of the model's files lies."""
    entries: dict[str, TensorEntry] = {}
    for path in safetensors_files(model_dir):
        entries.update(index_file(path))
    return entries


def _read_into(f, entry: TensorEntry, out: torch.Tensor) -> None:
    """The entry's bytes into `out` (contiguous, the entry's dtype and element count)."""
    view = memoryview(out.view(torch.uint8).numpy()).cast("B")
    if view.nbytes != entry.nbytes:
        raise ValueError(
            f"{entry.path.name}: {entry.nbytes} bytes on disk for {view.nbytes} expected"
        )
    f.seek(entry.offset)
    if f.readinto(view) != entry.nbytes:
        raise ValueError(f"{entry.path.name} is truncated")


def read_planned(
    plan: dict[str, list[str]],
    entries: dict[str, TensorEntry],
    dtype: torch.dtype,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Each planned weight as one tensor of `dtype`, its parts read into consecutive rows."""
    out: dict[str, torch.Tensor] = {}
    files: dict[Path, object] = {}
    try:
        for i, (name, parts) in enumerate(plan.items(), 1):
            shapes = [entries[p].shape for p in parts]
            if any(s[1:] != shapes[0][1:] for s in shapes):
                raise ValueError(f"{name}: parts {parts} do not stack ({shapes})")
            rows = [s[0] if s else 1 for s in shapes]
            target = torch.empty([sum(rows), *shapes[0][1:]] if shapes[0] else [], dtype=dtype)
            start = 0
            for part, n in zip(parts, rows):
                entry = entries[part]
                f = files.get(entry.path) or files.setdefault(entry.path, open(entry.path, "rb"))
                dest = target[start : start + n] if target.dim() else target
                if entry.dtype == dtype:
                    _read_into(f, entry, dest)
                else:  # another dtype on disk: converted into place from the file's mapping, not read first
                    dest.copy_(
                        MappedWeight(
                            entry.path, entry.offset, entry.nbytes, entry.dtype, entry.shape
                        ).tensor.reshape(dest.shape)
                    )
                start += n
            out[name] = target
            if progress is not None:
                progress(i, len(plan))
    finally:
        for f in files.values():
            f.close()
    return out


def load_model(
    model_dir: str,
    hf_config,
    dtype: torch.dtype,
    device: str,
    max_positions: int,
    progress=None,
    quantization: str = "none",
) -> tuple[LlamaForCausalLM, ModelConfig]:
    cfg = model_config_from_hf(hf_config, model_dir)
    cos, sin = rotary_tables(hf_config, cfg.head_dim, max_positions, dtype, device)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, cos.to("meta"), sin.to("meta"))
    entries = index_weights(model_dir)
    plan = weight_plan(cfg, set(entries))
    shapes = linear_shapes(model)
    stored = load_stored(
        model_dir,
        quantization,
        shapes,
        cfg,
        lambda names: read_planned({n: plan[n] for n in names}, entries, torch.float32),
    )
    if stored is not None:  # quantized weights at hand: the float ones of those layers stay unread
        plan = {
            k: v
            for k, v in plan.items()
            if not (k.endswith(".weight") and k.removesuffix(".weight") in shapes)
        }
    # mapped only where gathers alone read it: a tied lm_head left plain would stream the mapping's small
    # file pages every step (float32 on AVX-512 CPUs, ENGINE_PACK_WEIGHTS=0), so it is read there
    head_own = (
        not cfg.tie_word_embeddings or quantization != "none" or packing_available(dtype, device)
    )
    embed_parts, mapped = plan["embed_tokens.weight"], None
    entry = entries[embed_parts[0]]
    if head_own and mappable(entry.dtype, dtype, len(embed_parts), device):
        mapped = MappedWeight(entry.path, entry.offset, entry.nbytes, entry.dtype, entry.shape)
        plan = {k: v for k, v in plan.items() if k != "embed_tokens.weight"}
    # packed layers (none, on CPUs where packing pays) are packed from views of the file: their float
    # weights are never read into memory (weight_views.py)
    packed_from_file = set()
    if quantization == "none" and packing_available(dtype, device):
        packed_from_file = {
            f"{n}.weight"
            for n in shapes  # a bfloat16 lm_head is read: Float32Head may keep it
            if not ((cfg.tie_word_embeddings or dtype == torch.bfloat16) and n == "lm_head")
        }
    total = len(plan)
    plan, deferred = (
        {k: v for k, v in plan.items() if k not in packed_from_file},
        {k: v for k, v in plan.items() if k in packed_from_file},
    )
    state = read_planned(plan, entries, dtype, progress and (lambda i, n: progress(i, total)))
    if mapped is not None:
        state["embed_tokens.weight"] = mapped.tensor
    if device != "cpu":
        state = {k: v.to(device) for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    left_to_quantized = {f"{n}.weight" for n in shapes} if stored is not None else set()
    missing = [
        m
        for m in missing
        if not (cfg.tie_word_embeddings and m == "lm_head.weight")
        and m not in left_to_quantized
        and m not in deferred
    ]
    if missing or unexpected:
        raise ValueError(
            f"weights do not fit the model: missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rope_cos, model.rope_sin = cos, sin
    model.eval()
    del state  # the model holds the weights now; quantization and packing must be able to free the plain ones
    model = quantize_model(model, quantization, model_dir, stored)
    if quantization == "none":
        # on the CPU: oneDNN's layout or our kernels' panels, once (packed_linear.py); a float32 tied lm_head's copy is paid for by
        # the mapped embedding, and without it would be 113 MB more
        views, done = WeightViews(), len(plan)

        def weights(name: str) -> torch.Tensor:
            nonlocal done
            done += 1
            if progress is not None:
                progress(done, total)
            return views.stacked([entries[p] for p in deferred[f"{name}.weight"]], dtype)

        def reference(name: str) -> torch.Tensor:  # a converted weight, to check the blocks against
            parts = deferred.get(f"{name}.weight")
            return (
                views.stacked([entries[p] for p in parts], dtype)
                if parts
                else model.get_submodule(name).weight
            )

        on_f32 = dtype == torch.float32 and bool(
            deferred
        )  # packed for f32_linear (or oneDNN) from the file
        try:
            # the GGUF blocks the float32 weights were converted from, where they are those weights exactly
            # (f32_block_linear.py); else the float panels, mapped from the panel cache or packed
            blocks = (
                exact_blocks(model_dir, cfg, shapes, reference, our_kernel_library(dtype))
                if on_f32
                else None
            )
            panels = mapped_panels(model_dir, shapes) if on_f32 and blocks is None else None
            pack_linears(
                model,
                dtype,
                device,
                copy_tied_head=dtype != torch.float32 or mapped is not None,
                weights=weights if deferred else None,
                panels=panels,
                blocks=blocks,
            )
        finally:
            views.close()
        if on_f32 and panels is None and blocks is None:
            keep_panels(model_dir, model)  # the next start maps them (panel_cache.py)
        if progress is not None and (panels or blocks):
            progress(total, total)  # the mapped layers were never read
        if (
            dtype == torch.bfloat16
        ):  # float32 logits (float32_head.py); packing leaves the lm_head to this
            from engine.kernels.cpu import load_native

            model.lm_head = Float32Head(
                model.lm_head, load_native() if torch.device(device).type == "cpu" else None
            )
        unread = [n for n, p in model.named_parameters() if p.is_meta]
        if unread:
            raise ValueError(f"weights left unloaded: {unread[:8]}")
        install_exact(
            model
        )  # decode steps on our exact linear kernels: fused_decode.py's direct calls
    if mapped is not None:  # a tied lm_head quantized or packed from the embedding read all of it
        mapped.drop_pages()
    return model, cfg
