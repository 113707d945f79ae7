"""Build the decoder from a Hugging Face directory (config.json + safetensors), reporting progress.

Weights are read with plain file reads straight into the tensors the model keeps: fused projections
(qkv, gate_up) get their parts read into their rows, nothing is concatenated afterwards. Only the token
embedding stays memory-mapped on the CPU (mapped_weight.py: it is gathered from, a few rows a token);
reading every weight through a mapping left every page of the file resident in the scheduler beside
the fused copies, twice the model's size. Weights packed at load come from mappings of the
file instead, one at a time, their pages given back once used (weight_views.py); weights converted to
another dtype are converted from a mapping too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from engine.linear import panel_cache
from engine.linear.build import FROM_FILE, NO_FLOATS, Sources, make
from engine.linear.choose import Choice, Layer, Where, choose, may_use
from engine.linear.here import native_library, where_here
from engine.linear.parallel import Collectives
from engine.linear.swap import release_freed_memory, replace_linears
from engine.model.config import ModelConfig, model_config_from_hf
from engine.model.layout import WholeModel, model_layout
from engine.model.llama import LlamaForCausalLM
from engine.model.mapped_weight import MappedWeight, mappable
from engine.model.rope import rotary_tables
from engine.model.safetensors_io import TensorEntry, index_file
from engine.model.weight_views import WeightViews
from engine.quantization import cache, load_stored


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
    kernel_overrides: dict[str, str] | None = None,
    group: Collectives | None = None,
    reduce_like_tp: int = 0,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """The model with every weight loaded and each linear layer on the implementation the choice table
    (engine/linear/choose.py) picks; the choices are kept on the model (linear_choices, decode_choice).
    With a tensor-parallel group: this rank's shard of the model (model.cfg its heads and rows; the
    returned config the whole model's), its row-parallel layers and lm_head summing or gathering.
    reduce_like_tp > 1: the row-parallel layers summed as that many ranks sum them."""
    cfg = model_config_from_hf(hf_config, model_dir)
    layout = model_layout(cfg, group, reduce_like_tp)
    cos, sin = rotary_tables(hf_config, cfg.head_dim, max_positions, dtype, device)
    model = layout.meta_model(cos, sin)
    entries = index_weights(model_dir)
    plan = layout.weight_plan(set(entries))
    shapes, tied = layout.shapes, layout.tied
    lib = native_library(quantization, dtype, device)
    where = where_here(
        quantization, dtype, device, tied, lib, kernel_overrides or {}, tp=layout.like_tp
    )
    views = WeightViews()
    try:
        src = Sources(lib=lib, tied=tied)
        src.stored = load_stored(  # quantized weights at hand: those layers' floats stay unread
            model_dir,
            quantization,
            layout.whole_shapes,
            cfg,
            lambda names: read_planned({n: plan[n] for n in names}, entries, torch.float32),
            whole_rows=layout.tp,
        )
        src.stored = layout.cut_stored(src.stored, quantization)
        where, mapped = _map_embedding(where, plan, entries, dtype, device)
        where = _find_weights(where, src, model_dir, layout, plan, entries, views, dtype)
        choices = {
            n: choose(where, Layer(n, *shapes[n], model.get_submodule(n).bias is not None))
            for n in shapes
        }
        now, later = _split_plan(plan, choices, mapped is not None, src.stored is not None)
        now, later, unread = layout.read_plan(now, later, choices)
        total = len(now) + len(later)
        state = read_planned(now, entries, dtype, progress and (lambda i, n: progress(i, total)))
        state = layout.cut_floats(state)
        if mapped is not None:
            state["embed_tokens.weight"] = mapped.tensor
        if device != "cpu":
            state = {k: v.to(device) for k, v in state.items()}
        unread |= set(later) | (
            {f"{n}.weight" for n in shapes} if src.stored is not None else set()
        )
        _assign(model, state, unread | ({"lm_head.weight"} if tied else set()))
        del state  # the model holds the weights now: replacing a layer frees its plain weight
        model.rope_cos, model.rope_sin = cos, sin
        model.eval()
        src.file_weight = _file_weights(later, entries, views, dtype, progress, total, len(now))
        _replace_linears(model, choices, src)
        layout.finish(model)
    finally:
        views.close()
    _keep_new_weights(model, model_dir, quantization, where, src)
    if progress is not None and (src.panels or (src.blocks and quantization == "none")):
        progress(total, total)  # the mapped layers were never read
    unread = [n for n, p in model.named_parameters() if p.is_meta]
    if unread:
        raise ValueError(f"weights left unloaded: {unread[:8]}")
    model.linear_choices = choices
    model.choose_decode_path(where, lib)
    if mapped is not None:  # a tied lm_head quantized or packed from the embedding read all of it
        mapped.drop_pages()
    return model, cfg


def _map_embedding(
    where: Where, plan: dict, entries: dict, dtype: torch.dtype, device: str
) -> tuple[Where, MappedWeight | None]:
    """The embedding stays mapped from the file (only gathered from, a few rows a token) where its bytes
    are the tensor and no plain tied lm_head would stream the mapping's pages every step."""
    head_own = not where.tied or where.mode != "none" or where.packs
    parts = plan["embed_tokens.weight"]
    entry = entries[parts[0]]
    if not (head_own and mappable(entry.dtype, dtype, len(parts), device)):
        return where, None
    mapped = MappedWeight(entry.path, entry.offset, entry.nbytes, entry.dtype, entry.shape)
    return where.found(embedding_mapped=True), mapped


def _find_weights(
    where: Where,
    src: Sources,
    model_dir: str,
    layout: WholeModel,
    plan: dict,
    entries: dict,
    views: WeightViews,
    dtype: torch.dtype,
) -> Where:
    """Weights that spare reading or packing the float ones: the GGUF blocks the float32 weights are
    exactly (the layout's, f32_blocks.py), else f32_linear panels kept by an earlier start
    (panel_cache.py)."""
    shapes = layout.shapes
    if where.mode in ("gguf", "gguf-q8"):
        src.blocks = src.stored
        return where
    if may_use(where, "f32-blocks"):

        def reference(name: str) -> torch.Tensor:  # a converted weight, as a view of the file
            parts = plan.get(f"{name}.weight") or plan["embed_tokens.weight"]  # tied lm_head
            return views.stacked([entries[p] for p in parts], dtype)

        src.blocks = layout.exact_blocks(model_dir, reference, src.lib)
        if src.blocks is not None:
            return where.found(
                exact_blocks=True, unblocked=frozenset(set(shapes) - set(src.blocks))
            )
    if may_use(where, "f32-panels-cached"):
        src.panels = panel_cache.mapped_panels(model_dir, shapes)
        return where.found(cached_panels=frozenset(src.panels or ()))
    return where


def _split_plan(
    plan: dict, choices: dict[str, Choice], mapped: bool, quantized: bool
) -> tuple[dict, dict]:
    """(the weights to read now, those packed later from views of the file). The float weights of
    layers that need none (quantized with their weights at hand, GGUF blocks, cached panels) and a
    mapped embedding are not read at all."""
    now, later = {}, {}
    for key, parts in plan.items():
        layer = key.removesuffix(".weight")
        choice = choices.get(layer) if key.endswith(".weight") else None
        if (key == "embed_tokens.weight" and mapped) or (choice is not None and quantized):
            continue
        packed = choice is not None and (choice.impl in FROM_FILE or choice.impl in NO_FLOATS)
        (later if packed else now)[key] = parts
    return now, later


def _assign(model: LlamaForCausalLM, state: dict, unread: set[str]) -> None:
    """The read weights into the model; a tied lm_head made the embedding."""
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if m not in unread]
    if missing or unexpected:
        raise ValueError(
            f"weights do not fit the model: missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    if model.cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight


def _file_weights(deferred, entries, views, dtype, progress, total, done):
    """name -> that layer's float weight as a view of the file (valid until the next call), counted."""

    def weight(name: str) -> torch.Tensor:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)
        return views.stacked([entries[p] for p in deferred[f"{name}.weight"]], dtype)

    return weight


def _replace_linears(model: LlamaForCausalLM, choices: dict[str, Choice], src: Sources) -> None:
    """Every linear layer on its chosen implementation; the replaced plain weights given back."""
    if all(c.impl == "torch" for c in choices.values()):
        return
    replace_linears(model, lambda name, linear: make(choices[name], name, linear, src))
    release_freed_memory(collect=False)  # plain nn.Linear layers: no reference cycles


def _keep_new_weights(model, model_dir: str, mode: str, where: Where, src: Sources) -> None:
    """Weights made at this start that the next one maps instead: int8's, f32_linear's panels."""
    if mode == "int8" and src.stored is None:
        cache.save_cached(cache.cache_file(model_dir, mode), src.fresh, model_dir, mode)
    if may_use(where, "f32-panels-cached") and src.panels is None and not where.exact_blocks:
        panel_cache.keep_panels(model_dir, model)


def kernel_info(model: LlamaForCausalLM) -> dict:
    """What the load chose, for /server_info and `engine info`: the linear layers' classes, the table's
    row and reason for each kind of layer (qkv_proj, ..., lm_head), and the decode path."""
    kinds: dict[str, list[str]] = {}
    for name, choice in model.linear_choices.items():
        line = f"{choice.row}: {choice.reason}"
        lines = kinds.setdefault(name.rsplit(".", 1)[-1], [])
        if line not in lines:
            lines.append(line)
    classes = {
        type(m).__name__
        for n, m in model.named_modules()
        if n.endswith(("_proj", "lm_head", ".inner"))  # .inner: a tensor-parallel wrapper's layer
    }
    decode = model.decode_choice
    return {
        "linear_layers": sorted(classes),
        "linear_choices": {kind: "; ".join(lines) for kind, lines in kinds.items()},
        "decode_path": f"{decode.row}: {decode.reason}",
    }
