"""Tensor parallelism (docs/tensor-parallel.md): the weight shards, the choice table under `tp`, and
two gloo ranks against one scheduler on the embedded SmolLM2: the same greedy tokens, logprobs
within 1e-4, a rerun bitwise the same, the request features, and a killed rank ending the engine."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from conftest import PROMPTS
from engine.config import EngineConfig
from engine.kernels.cpu import load_native
from engine.linear import f32_blocks
from engine.distributed.shard import Shard, column_cuts, shard_blocks, shard_floats
from engine.linear.shard_sums import ShardSumLinear
from engine.linear.choose import Layer, Where, choose, choose_decode_path
from engine.linear.gguf import BLOCK_BYTES, dequantize
from engine.model.config import ModelConfig
from helpers import engine_idle, wait_gone, wait_path_gone

NEW_TOKENS = 32
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0}


def _config(**kw) -> ModelConfig:
    base = dict(
        architecture="LlamaForCausalLM",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=2,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        max_position_embeddings=256,
        eos_token_ids=(2,),
    )
    return ModelConfig(**{**base, **kw})


# ---------------------------------------------------------------------- shards (no processes)


def test_two_ranks_split_smollm2_by_kv_groups():
    cfg = _config()
    r0, r1 = Shard.plan(cfg, 0, 2), Shard.plan(cfg, 1, 2)
    assert (r0.kv_heads, r0.heads) == (range(0, 2), range(0, 6))
    assert (r1.kv_heads, r1.heads) == (range(2, 3), range(6, 9))
    assert (r0.inter, r1.inter) == (range(0, 768), range(768, 1536))
    assert r0.vocab_widths == (24576, 24576)
    local = r1.local_config(cfg)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (3, 1, 768)
    assert not local.tie_word_embeddings  # a rank's head is its own slice
    with pytest.raises(ValueError, match="KV heads"):
        Shard.plan(cfg, 0, 4)


def test_float_shards_give_the_whole_products():
    """Column shards are the whole layer's rows (qkv: each rank's q, k, v); row shards sum to it."""
    torch.manual_seed(0)
    cfg = _config(hidden_size=64, intermediate_size=128, vocab_size=160, head_dim=8)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    whole = {
        "layers.0.self_attn.qkv_proj.weight": torch.randn(q + 2 * kv, 64),
        "layers.0.self_attn.o_proj.weight": torch.randn(64, q),
        "layers.0.mlp.gate_up_proj.weight": torch.randn(2 * 128, 64),
        "layers.0.mlp.down_proj.weight": torch.randn(64, 128),
        "lm_head.weight": torch.randn(160, 64),
    }
    shards = [shard_floats(whole, Shard.plan(cfg, r, 2), cfg) for r in range(2)]
    for name in ("layers.0.self_attn.o_proj.weight", "layers.0.mlp.down_proj.weight"):
        x = torch.randn(5, whole[name].shape[1])
        plans = [Shard.plan(cfg, r, 2) for r in range(2)]
        cols = [p.columns(name.rsplit(".", 1)[0], cfg) for p in plans]
        parts = [x[:, c.start : c.stop] @ s[name].T for c, s in zip(cols, shards)]
        torch.testing.assert_close(parts[0] + parts[1], x @ whole[name].T)
    qkv = "layers.0.self_attn.qkv_proj.weight"
    w, (a, b) = whole[qkv], (s[qkv] for s in shards)
    q0, k0 = 6 * 8, 2 * 8  # rank 0: q heads 0-5, KV heads 0-1
    torch.testing.assert_close(torch.cat([a[:q0], b[: q - q0]]), w[:q])
    torch.testing.assert_close(torch.cat([a[q0 : q0 + k0], b[q - q0 : q - q0 + 8]]), w[q : q + kv])
    gate_up = "layers.0.mlp.gate_up_proj.weight"
    a, b = shards[0][gate_up], shards[1][gate_up]
    torch.testing.assert_close(torch.cat([a[:64], b[:64]]), whole[gate_up][:128])
    torch.testing.assert_close(torch.cat([a[64:], b[64:]]), whole[gate_up][128:])
    torch.testing.assert_close(
        torch.cat([shards[0]["lm_head.weight"], shards[1]["lm_head.weight"]]),
        whole["lm_head.weight"],
    )


def test_block_shards_are_the_float_shards():
    """GGUF blocks (Q8_0 here) cut as the floats are, columns on block boundaries."""
    torch.manual_seed(1)
    cfg = _config(hidden_size=64, intermediate_size=128, vocab_size=64, head_dim=8)
    n, k = 64, 128  # down_proj: 64 x 128, two blocks of 32 columns a rank
    d = torch.rand(n, k // 32, 1).half().view(torch.uint8)
    qs = torch.randint(-127, 128, (n, k // 32, 32), dtype=torch.int8).view(torch.uint8)
    blocks = torch.cat([d.reshape(n, k // 32, 2), qs], -1).reshape(n, -1)
    whole = dequantize(8, blocks, k)
    for rank in range(2):
        shard = Shard.plan(cfg, rank, 2)
        kind, part = shard_blocks({"layers.0.mlp.down_proj": (8, blocks)}, shard, cfg, BLOCK_BYTES)[
            "layers.0.mlp.down_proj"
        ]
        cols = shard.columns("layers.0.mlp.down_proj", cfg)
        assert torch.equal(dequantize(kind, part, len(cols)), whole[:, cols.start : cols.stop])


def test_a_shard_that_would_cut_blocks_apart():
    """Columns off block boundaries: the gguf modes refuse; the exact mode leaves that layer out of
    its blocks (the table gives it the next row, on its float shard)."""
    cfg = _config(hidden_size=64, intermediate_size=100, vocab_size=64, head_dim=8)
    down = {"layers.0.mlp.down_proj": (8, torch.zeros(64, 4 * 34, dtype=torch.uint8))}
    shard = Shard.plan(cfg, 1, 2)
    assert shard.inter == range(50, 100)
    with pytest.raises(ValueError, match="block"):
        shard_blocks(down, shard, cfg, BLOCK_BYTES)
    assert shard_blocks(down, shard, cfg, BLOCK_BYTES, strict=False) == {}


def test_row_parallel_columns_of_every_rank_in_order():
    """reduce_like_tp's cuts: each rank's columns, in rank order, covering the layer once."""
    cfg = _config()
    assert column_cuts("layers.0.self_attn.o_proj", cfg, 2) == [range(0, 384), range(384, 576)]
    assert column_cuts("layers.1.mlp.down_proj", cfg, 3) == [
        range(0, 512),
        range(512, 1024),
        range(1024, 1536),
    ]
    assert column_cuts("layers.0.mlp.gate_up_proj", cfg, 2) is None
    with pytest.raises(ValueError, match="bias"):
        ShardSumLinear(torch.nn.Linear(4, 4), [range(0, 2), range(2, 4)])


@pytest.mark.skipif(load_native() is None, reason="no C compiler: no quantized kernels")
@pytest.mark.parametrize("n", [576, 584])  # panels; not a multiple of 16: the row-major kernels
@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("mode", ["gguf", "gguf-q8", "int8"])
def test_summing_like_ranks_is_the_ranks_sum_bitwise(mode, rows, n):
    """A row-parallel layer summed like three ranks is bitwise the sum, in rank order, of each rank's
    shard computed alone: down_proj of an intermediate size of 80 blocks (SmolLM2-360M's 2,560),
    cut in pairs of blocks (28 + 26 + 26; 27 + 27 + 26 parted in the gguf kernel, which takes blocks
    two at a time), at the row counts of each kernel path."""
    from engine.linear.gguf import GGUFLinear
    from engine.linear.int8 import Int8Linear, in_panels, panels, quantize_rows
    from test_gguf_quantization import random_blocks

    lib, gen = load_native(), torch.Generator().manual_seed(7)
    cfg = _config(intermediate_size=2560)
    cuts = column_cuts("layers.0.mlp.down_proj", cfg, 3)
    assert [len(c) for c in cuts] == [896, 832, 832]
    k = 2560
    if mode == "int8":
        q, scale = quantize_rows(torch.randn(n, k, generator=gen))
        store = (lambda t: panels(t)) if in_panels(n) else (lambda t: t)

        def layer(c: range) -> Int8Linear:
            part = q[:, c.start : c.stop].contiguous()
            meta = torch.empty(n, len(c), device="meta")
            return Int8Linear(meta, None, lib, 1, (store(part), scale))

    else:
        blocks = random_blocks(3, n, k, gen)  # Q4_1, 20 bytes a block

        def layer(c: range) -> GGUFLinear:
            part = blocks[:, c.start // 32 * 20 : c.stop // 32 * 20].contiguous()
            return GGUFLinear(3, part, (n, len(c)), None, lib, 1, mode == "gguf-q8")

    x = torch.randn(rows, k, generator=gen)
    want = None
    for c in cuts:
        part = layer(c)(x[:, c.start : c.stop].contiguous())
        want = part if want is None else want + part
    got = ShardSumLinear(layer(range(k)), cuts)(x)
    assert torch.equal(got, want)


def test_the_table_under_tensor_parallelism():
    """Under tp the exact mode computes from each rank's block shard; rows that take a whole file's
    weights (the embedding as the head) step aside; decode steps take the plain forward."""
    facts = dict(packs=True, f32_kernel=True, f32_blocks_kernel=True, exact_blocks=True)
    one = Where("none", "float32", "cpu", tied=True, **facts)
    tp = Where("none", "float32", "cpu", tied=True, tp=True, **facts)
    qkv, head = (
        Layer("layers.0.self_attn.qkv_proj", 640, 576, False),
        Layer("lm_head", 128, 576, False),
    )
    assert choose(one, qkv).row == "f32-blocks"
    assert choose(tp, qkv).row == "f32-blocks"
    assert choose(tp, head).row == "f32-blocks"
    # a shard not in whole panels of 16 rows: that layer alone takes the next row
    assert choose(tp, Layer("layers.0.self_attn.qkv_proj", 648, 576, False)).row == "f32-mkl"
    assert choose(tp.found(exact_blocks=False), head).row not in ("f32-blocks", "tied-head-shared")
    cut = tp.found(unblocked=frozenset({"layers.0.mlp.down_proj"}))
    assert choose(cut, Layer("layers.0.mlp.down_proj", 576, 768, False)).row == "f32-mkl"
    assert choose(cut, Layer("layers.1.mlp.down_proj", 576, 768, False)).row == "f32-blocks"
    assert choose_decode_path(one, {"f32_blocks"}).row == "decode-layers-c"
    assert choose_decode_path(tp, {"f32_panels"}).row == "tensor-parallel"
    gguf = Where("gguf", "float32", "cpu", tied=True, tp=True)
    assert choose_decode_path(gguf, {"gguf"}).row == "tensor-parallel"


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"tp_size": 0}, "tp_size"),
        ({"tp_size": 2, "nnodes": 2}, "dist_init_addr"),
        ({"tp_size": 3, "nnodes": 2, "dist_init_addr": "h:1"}, "multiple"),
        ({"nnodes": 2, "node_rank": 2, "tp_size": 2, "dist_init_addr": "h:1"}, "node_rank"),
        ({"reduce_like_tp": -1}, "reduce_like_tp"),
        ({"reduce_like_tp": True}, "reduce_like_tp"),
        ({"reduce_like_tp": 3, "tp_size": 2}, "only 0, 1 or tp_size"),
        ({"reduce_like_tp": 2, "device": "cuda"}, "CPU only"),
        ({"dist_init_addr": "nowhere"}, "host:port"),
    ],
)
def test_config_refuses_what_does_not_fit(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(**fields)


# ---------------------------------------------------------------------- two ranks


@pytest.fixture(scope="module")
def chat_ids(tokenizer) -> list[list[int]]:
    from engine.bench.quality import parity_inputs

    return parity_inputs(tokenizer)


@pytest.fixture(scope="module")
def tp2():
    from engine import Engine

    eng = Engine(dtype="float32", max_total_tokens=16384, tp_size=2)
    yield eng
    eng.shutdown()


def _run(eng, ids, tokens: int = NEW_TOKENS) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs, every prompt prefilled whole (the cache flushed first)."""
    eng.flush_cache()
    params = {**GREEDY, "max_new_tokens": tokens}
    outs = eng.generate(input_ids=ids, sampling_params=params, return_logprob=True)
    return [
        (o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]])
        for o in outs
    ]


def test_two_ranks_give_one_schedulers_tokens(engine, tp2, chat_ids):
    """Both compute from the GGUF blocks (each rank from its block shard), in float32."""
    assert tp2.server_info["tp_size"] == 2
    assert tp2.server_info["decode_path"].startswith("tensor-parallel")
    if f32_blocks.runs_here(load_native()):  # AVX2, FMA, F16C and a C compiler
        for info in (engine.server_info, tp2.server_info):
            choices = info["linear_choices"]
            assert set(choices) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"}
            assert all(why.startswith("f32-blocks:") for why in choices.values()), choices
    one, two = _run(engine, chat_ids), _run(tp2, chat_ids)
    for (ids1, lp1), (ids2, lp2) in zip(one, two):
        assert ids2 == ids1
        assert max(abs(a - b) for a, b in zip(lp1, lp2)) <= 1e-4
    assert _run(tp2, chat_ids) == two  # a rerun: bitwise the same


def test_request_features_under_two_ranks(engine, tp2, chat_ids):
    # n > 1, seeded: the same draws as one scheduler's
    params = {"max_new_tokens": 12, "temperature": 0.8, "n": 3, "seed": 7}
    assert [o["output_ids"] for o in tp2.generate(PROMPTS[0], params)] == [
        o["output_ids"] for o in engine.generate(PROMPTS[0], params)
    ]
    # unseeded sampling: every rank draws alike (or they would part and hang)
    outs = tp2.generate(PROMPTS[:4], {"max_new_tokens": 12, "temperature": 1.0})
    assert all(o["meta_info"]["completion_tokens"] >= 1 for o in outs)
    # beam search: the same beams
    beams = dict(beam_width=3, max_new_tokens=8, num_return_sequences=2)
    hyps = [h["output_ids"] for h in tp2.beam_search(PROMPTS[2], **beams)["hypotheses"]]
    assert hyps == [h["output_ids"] for h in engine.beam_search(PROMPTS[2], **beams)["hypotheses"]]
    # a grammar
    out = tp2.generate(PROMPTS[1], {"max_new_tokens": 8, "regex": "[0-9]{3}"})
    assert len(out["text"]) == 3 and out["text"].isdigit()
    # an abort
    stream = tp2.generate(
        PROMPTS[0], {"max_new_tokens": 2000, "ignore_eos": True}, stream=True, rid="tp-abort"
    )
    chunks = []
    for i, chunk in enumerate(stream):
        chunks.append(chunk)
        if i == 3:
            tp2.abort("tp-abort")
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert engine_idle(tp2.get_stats())


def test_hidden_states_and_steering_under_two_ranks(engine, tp2, chat_ids):
    """The residual stream is whole on every rank: the same steered tokens as one scheduler's, and
    hidden states equal to its own within the all-reduce's reordering."""
    hidden = engine.server_info["hidden_size"]
    vector = (torch.randn(hidden, generator=torch.Generator().manual_seed(5)) * 4.0).tolist()
    fields = dict(
        return_hidden_states={"layers": [3, -1], "tokens": "all"},
        steering=[{"layer": 8, "vector": vector}],
    )
    greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    one = engine.generate(input_ids=chat_ids[0], sampling_params=greedy, **fields)
    two = tp2.generate(input_ids=chat_ids[0], sampling_params=greedy, **fields)
    assert two["output_ids"] == one["output_ids"]
    for part in ("prompt", "generated"):
        a, b = one["meta_info"]["hidden_states"][part], two["meta_info"]["hidden_states"][part]
        scale = a.abs().amax(dim=-1).clamp(min=1.0)
        assert float(((a - b).abs().amax(dim=-1) / scale).max()) <= 1e-5
    # a beam search: each hypothesis's own rows, gathered on every rank alike
    search = dict(beam_width=2, num_return_sequences=2, max_new_tokens=6)
    hidden_fields = {"return_hidden_states": {"layers": [-1], "tokens": "generated"}}
    one = engine.beam_search(input_ids=chat_ids[1], **search, **hidden_fields)
    two = tp2.beam_search(input_ids=chat_ids[1], **search, **hidden_fields)
    assert [h["output_ids"] for h in two["hypotheses"]] == [
        h["output_ids"] for h in one["hypotheses"]
    ]
    for a, b in zip(
        one["meta_info"]["hidden_states"]["generated"],
        two["meta_info"]["hidden_states"]["generated"],
    ):
        assert a.shape == b.shape
        scale = a.abs().amax(dim=-1).clamp(min=1.0)
        assert float(((a - b).abs().amax(dim=-1) / scale).max()) <= 1e-5


def test_engine_dump_finds_every_rank(tp2):
    """`engine dump` (and `engine profile`, by the same discovery) records rank 1's scheduler too,
    by its title engine::tp-rank1."""
    import subprocess
    import sys

    from engine.profiling.discover import engine_processes

    mine = [e for e in engine_processes(os.getpid()) if e["scheduler"] == tp2.pids["scheduler"]]
    assert mine == [
        {
            "user": os.getpid(),
            "scheduler": tp2.pids["scheduler"],
            "scheduler-rank1": tp2.pids["scheduler rank 1"],
            "detokenizer": tp2.pids["detokenizer"],
        }
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "engine.profiling.cli", "dump", "--pid", str(os.getpid())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    header = f"==== scheduler-rank1 (pid {tp2.pids['scheduler rank 1']}) ===="
    assert header in proc.stdout
    rank1 = proc.stdout.split(header, 1)[1].split("\n==== ", 1)[0]
    assert "serve_forever" in rank1  # rank 1's own loop
    wrong = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine.profiling.cli",
            "dump",
            "--pid",
            str(mine[0]["scheduler-rank1"]),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert wrong.returncode == 2
    assert (
        f"is the scheduler-rank1 of the engine whose user process is {os.getpid()}" in wrong.stderr
    )


def _pids(eng) -> list[int]:
    return [pid for role, pid in eng.pids.items() if role != "user"]


def test_memory_pressure_then_a_killed_rank_ends_the_engine():
    """A pool too small for the batch retracts and finishes every request; then SIGKILL on rank 1
    mid-request: the caller gets EngineDeadError naming it, and no process is left."""
    from engine import Engine
    from engine.errors import EngineDeadError

    eng = Engine(dtype="float32", max_total_tokens=400, max_running_requests=8, tp_size=2)
    try:
        params = {"max_new_tokens": 60, "temperature": 0, "ignore_eos": True}
        outs = eng.generate(PROMPTS, params)
        assert all(len(o["output_ids"]) == 60 for o in outs)
        stats = eng.get_stats()
        assert stats["retracted_requests"] > 0, stats
        pids, runtime_dir = _pids(eng), eng.runtime_dir
        caught = []

        def wait_for_one():
            try:
                eng.generate(PROMPTS[0], {"max_new_tokens": 380, "ignore_eos": True})
            except BaseException as exc:  # noqa: BLE001
                caught.append(exc)

        worker = threading.Thread(target=wait_for_one)
        worker.start()
        time.sleep(1.0)
        os.kill(eng.pids["scheduler rank 1"], signal.SIGKILL)
        worker.join(15)
        assert not worker.is_alive(), "the caller still waits on a dead rank"
        assert caught and isinstance(caught[0], EngineDeadError), caught
        assert "scheduler rank 1" in str(caught[0])
        assert wait_gone(pids, 10) == []
        assert wait_path_gone(runtime_dir, 5)
    finally:
        eng.shutdown()


def test_a_killed_rank_0_ends_the_engine():
    from engine import Engine
    from engine.errors import EngineDeadError

    eng = Engine(dtype="float32", max_total_tokens=2048, tp_size=2)
    try:
        pids = _pids(eng)
        os.kill(eng.pids["scheduler"], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while eng.alive and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(EngineDeadError, match="scheduler"):
            eng.generate("again")
        assert wait_gone(pids, 10) == []
    finally:
        eng.shutdown()


def test_one_scheduler_summing_like_two_ranks_is_bitwise_tp2(tp2, chat_ids):
    """reduce_like_tp=2: the row-parallel layers summed over the two ranks' columns, in rank order.
    The exact mode's TP=2 is then bitwise a single scheduler's, not within 1e-4."""
    from engine import Engine

    with Engine(dtype="float32", max_total_tokens=8192, reduce_like_tp=2) as eng:
        assert eng.server_info["decode_path"].startswith("tensor-parallel")
        assert eng.server_info["reduce_like_tp"] == 2
        assert _run(eng, chat_ids, 16) == _run(tp2, chat_ids, 16)


@pytest.mark.parametrize("mode", ["gguf", "gguf-q8"])
def test_block_modes_under_two_ranks_are_bitwise_one_summing_alike(mode, chat_ids, engine):
    """The block modes round each block of 32 activations to int16 (gguf) or int8 (gguf-q8) steps, so
    the ranks' sum, in another order than one scheduler's, moves values across a step now and then
    (gguf: logprobs 3.4e-3 from a plain TP=1; gguf-q8: other greedy tokens). Summed alike they are
    bitwise the same: the order is the only difference. gguf-q8 under TP=2 keeps the mode's quality."""
    from engine import Engine
    from engine.bench.quality import held_out_windows, prompt_perplexity

    got = {}
    for tp, like in ((1, 2), (2, 0)):
        with Engine(
            quantization=mode, max_total_tokens=8192, tp_size=tp, reduce_like_tp=like
        ) as eng:
            got[tp] = _run(eng, chat_ids, 16)
            if tp == 2 and mode == "gguf-q8":  # its bound (tests/test_gguf_q8.py) under TP=2
                windows = held_out_windows(engine.tokenizer, 2, 256)
                (exact, _), (q8, _) = (
                    prompt_perplexity(engine, windows),
                    prompt_perplexity(eng, windows),
                )
                assert abs(q8 / exact - 1) <= 0.02, (exact, q8)
    assert got[2] == got[1]


def test_int8_under_two_ranks_quantizes_whole_rows(chat_ids, model_dir, tmp_path, monkeypatch):
    """Each rank cuts int8 weights quantized from whole rows (quantized by the ranks where the cache
    lacks them, and cached: the TP=1 engines read that file), so a row-parallel layer keeps its
    whole row's scale: TP=1's tokens, logprobs within 1e-4, and bitwise TP=1 summing like two ranks."""
    import shutil

    from engine import Engine
    from engine.kernels.cpu import build
    from engine.quantization.cache import cache_file

    built = build.cached_library()  # the session's kernels: only the int8 weights are made here
    if built.exists() and build.unsafe_reason(built) is None:
        (tmp_path / "kernels").mkdir(mode=0o700)
        shutil.copy2(built, tmp_path / "kernels" / built.name)
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    assert not cache_file(model_dir, "int8").exists()
    got, stamp = {}, None
    for name, kw in (
        ("ranks, quantizing", {"tp_size": 2}),
        ("one like two", {"reduce_like_tp": 2}),  # from the cache the ranks wrote
        ("one", {}),
    ):
        with Engine(model_path=model_dir, quantization="int8", max_total_tokens=8192, **kw) as eng:
            got[name] = _run(eng, chat_ids, 16)
        path = cache_file(model_dir, "int8")
        stamp = stamp if name != "ranks, quantizing" else path.stat().st_mtime_ns
        assert path.stat().st_mtime_ns == stamp  # written by the first, then only read
    assert got["one like two"] == got["ranks, quantizing"]
    for (ids1, lp1), (ids2, lp2) in zip(got["one"], got["ranks, quantizing"]):
        assert ids2 == ids1
        assert max(abs(a - b) for a, b in zip(lp1, lp2)) <= 1e-4


def test_bfloat16_under_two_ranks_agrees_with_transformers_bf16(tokenizer, model_dir):
    """bfloat16 rounds every activation, so TP=2's other order of sums parts its greedy text from
    TP=1's (as batching does): held to the bound TP=1's bfloat16 is, against transformers'."""
    from engine import Engine
    from test_bf16_exact import (
        NEW_TOKENS as BF16_TOKENS,
        _prompts,
        assert_agrees_with_transformers_bf16,
    )

    ids = [tokenizer.encode(p) for p in _prompts()]
    params = {"max_new_tokens": BF16_TOKENS, "temperature": 0, "ignore_eos": True}
    with Engine(dtype="bfloat16", max_total_tokens=8192, tp_size=2) as eng:
        assert eng.server_info["dtype"] == "bfloat16"
        outs = [o["output_ids"] for o in eng.generate(input_ids=ids, sampling_params=params)]
    assert_agrees_with_transformers_bf16(ids, outs, model_dir)


def test_summing_like_more_ranks_than_kv_heads_is_refused_at_start():
    from engine import Engine
    from engine.errors import EngineStartError

    with pytest.raises(EngineStartError, match="4 ranks .*3 KV heads"):
        Engine(dtype="float32", max_total_tokens=1024, reduce_like_tp=4)


def test_three_ranks_sum_in_rank_order(chat_ids):
    """More than two ranks gather every rank's partial and add them in rank order (an all-reduce of
    three may add in any order): bitwise a single scheduler summing like three ranks."""
    from engine import Engine

    got = {}
    for tp, like in ((1, 3), (3, 3)):
        with Engine(
            quantization="gguf", max_total_tokens=4096, tp_size=tp, reduce_like_tp=like
        ) as eng:
            got[tp] = _run(eng, chat_ids[:4], 8)
    assert got[3] == got[1]


def test_two_machines_on_loopback(engine, chat_ids):
    """nnodes=2 on one machine: the Engine holds rank 0, `python -m engine.distributed.node` rank 1
    (which takes rank 0's settings); stopping that node ends the engine at its next request."""
    import subprocess
    import sys

    from engine import Engine
    from engine.distributed.address import free_loopback_address
    from engine.errors import EngineDeadError

    addr = free_loopback_address()
    node = subprocess.Popen(
        [sys.executable, "-m", "engine.distributed.node", "--tp", "2", "--nnodes", "2"]
        + ["--node-rank", "1", "--dist-init-addr", addr]
    )
    try:
        with Engine(
            dtype="float32",
            max_total_tokens=4096,
            tp_size=2,
            nnodes=2,
            dist_init_addr=addr,
            num_threads=1,
        ) as eng:
            params = {"max_new_tokens": 8, "temperature": 0}
            got = eng.generate(input_ids=chat_ids[:3], sampling_params=params)
            want = engine.generate(input_ids=chat_ids[:3], sampling_params=params)
            assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
            # `engine dump` on the node's machine finds its rank (no user process of its own there)
            dumped = subprocess.run(
                [sys.executable, "-m", "engine.profiling.cli", "dump", "--pid", str(node.pid)],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert dumped.returncode == 0, dumped.stderr
            assert f"==== node (pid {node.pid}) ====" in dumped.stdout
            rank1 = dumped.stdout.split("==== scheduler-rank1 (pid ", 1)[1]
            assert "serve_forever" in rank1
            node.send_signal(signal.SIGTERM)
            assert node.wait(15) == 0
            with pytest.raises(EngineDeadError):
                eng.generate("again", {"max_new_tokens": 4})
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()
