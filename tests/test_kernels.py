"""Attention backends against a plain SDPA reference: decode over scattered pool rows, extend with a prefix."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.kernels.attention import create_backend
from engine.linear.choose import native_extend
from engine.model.forward_batch import ForwardBatch, ForwardMode
from engine.kernels.cpu import load_native


class Pool:
    def __init__(self, n, hkv, d, dtype):
        self.k_buffers = [torch.randn(n, hkv, d).to(dtype)]
        self.v_buffers = [torch.randn(n, hkv, d).to(dtype)]


def _reference(q, keys, values, scale):
    """q [H, D] attends keys/values [L, Hkv, D], in float64."""
    h, hkv = q.shape[0], keys.shape[1]
    k = keys.double().repeat_interleave(h // hkv, 1).transpose(0, 1)
    v = values.double().repeat_interleave(h // hkv, 1).transpose(0, 1)
    w = torch.softmax((q.double()[:, None, :] * k).sum(-1) * scale, -1)
    return (w[:, :, None] * v).sum(1)


@pytest.mark.parametrize("head_dim", [64, 40])  # 64: the register-blocked path; 40: the generic one
@pytest.mark.parametrize("backend_name", ["torch", "cpu_native"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
# 1: fewer requests than threads, the native kernel splits by KV head
@pytest.mark.parametrize("b", [5, 1])
def test_decode_matches_reference(backend_name, dtype, tol, head_dim, b):
    if backend_name == "cpu_native" and load_native() is None:
        pytest.fail("no C compiler: the native kernel could not be built on this machine")
    torch.manual_seed(0)
    h, hkv, d, ctx = 9, 3, head_dim, 80
    pool = Pool(1000, hkv, d, dtype)
    table = torch.zeros(8, ctx, dtype=torch.int64)
    lens = torch.tensor([1, 7, 80, 33, 50])[:b] if b > 1 else torch.tensor([61])
    slots = torch.tensor([6, 0, 3, 1, 7])[:b]
    rows = torch.randperm(999)[: int(lens.sum())] + 1
    start = 0
    for s, n in zip(slots.tolist(), lens.tolist()):
        table[s, :n] = rows[start : start + n]
        start += n
    backend = create_backend(
        backend_name,
        "cpu",
        num_heads=h,
        num_kv_heads=hkv,
        head_dim=d,
        scale=d**-0.5,
        kv_pool=pool,
        req_to_token=table,
    )
    q = torch.randn(b, h, d).to(dtype)
    new_k = torch.randn(b, hkv, d).to(dtype)
    new_v = torch.randn(b, hkv, d).to(dtype)
    loc = table[slots, lens - 1]
    batch = ForwardBatch(
        ForwardMode.DECODE,
        torch.zeros(b, dtype=torch.long),
        lens - 1,
        loc,
        slots,
        lens,
        int(lens.max()),
        torch.arange(b),
    )
    backend.init_forward_metadata(batch)
    out = backend.forward(q, new_k, new_v, 0, batch)
    for i in range(b):
        idx = table[slots[i], : lens[i]]
        expected = _reference(q[i], pool.k_buffers[0][idx], pool.v_buffers[0][idx], d**-0.5)
        assert torch.allclose(out[i].double(), expected, atol=tol, rtol=tol), f"row {i}"
    assert torch.equal(pool.k_buffers[0][loc], new_k)


# head_dim 40, 72: not multiples of 16 (issue 13, item 1); 64 and 128 with 3 or 4 query heads a KV head: the
# native kernel's paths compiled for those counts (the rest take its general loop)
@pytest.mark.parametrize(
    "head_dim,heads",
    [
        (32, (6, 2)),
        (40, (6, 2)),
        (72, (6, 2)),
        (64, (6, 2)),
        (64, (8, 2)),
        (128, (8, 2)),
        (64, (10, 2)),
    ],
)
@pytest.mark.parametrize("backend_name", ["torch", "cpu_native", "auto"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_extend_with_prefix_matches_reference(backend_name, dtype, tol, head_dim, heads):
    """Three requests in one extend batch: one continues after a 21-token cached prefix, one starts fresh,
    one runs 145 keys deep (the native kernel's softmax steps of 64 keys, three of them, the last partial)."""
    if backend_name == "cpu_native" and load_native() is None:
        pytest.fail("no C compiler: the native kernel could not be built on this machine")
    torch.manual_seed(1)
    (h, hkv), d = heads, head_dim
    pool = Pool(300, hkv, d, dtype)
    table = torch.zeros(3, 160, dtype=torch.int64)
    prefix_lens, ext_lens, slots = [21, 0, 70], [19, 37, 75], [2, 0, 1]
    rows = (torch.randperm(299) + 1).tolist()
    for slot, n in zip(slots, (21 + 19, 37, 70 + 75)):
        table[slot, :n] = torch.tensor(rows[:n])
        rows = rows[n:]
    backend = create_backend(
        backend_name,
        "cpu",
        num_heads=h,
        num_kv_heads=hkv,
        head_dim=d,
        scale=d**-0.5,
        kv_pool=pool,
        req_to_token=table,
    )
    total = sum(ext_lens)
    q = torch.randn(total, h, d).to(dtype)
    k, v = torch.randn(total, hkv, d).to(dtype), torch.randn(total, hkv, d).to(dtype)
    loc = torch.cat([table[s, p : p + e] for s, p, e in zip(slots, prefix_lens, ext_lens)])
    positions = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix_lens, ext_lens)])
    seq_lens = torch.tensor([p + e for p, e in zip(prefix_lens, ext_lens)])
    batch = ForwardBatch(
        ForwardMode.EXTEND,
        torch.zeros(total, dtype=torch.long),
        positions,
        loc,
        torch.tensor(slots),
        seq_lens,
        int(seq_lens.max()),
        torch.cumsum(torch.tensor(ext_lens), 0) - 1,
        extend_lens=ext_lens,
        prefix_lens=prefix_lens,
    )
    backend.init_forward_metadata(batch)
    out = backend.forward(q, k, v, 0, batch)
    start = 0
    for slot, prefix, ext in zip(slots, prefix_lens, ext_lens):
        for i in range(ext):
            idx = table[slot, : prefix + i + 1]
            expected = _reference(
                q[start + i], pool.k_buffers[0][idx], pool.v_buffers[0][idx], d**-0.5
            )
            assert torch.allclose(out[start + i].double(), expected, atol=tol, rtol=tol), (slot, i)
        start += ext


def test_auto_falls_back_to_torch_for_shapes_the_native_kernel_does_not_handle():
    from engine.kernels.attention.torch_backend import TorchAttentionBackend

    shape = dict(
        num_heads=80,
        num_kv_heads=8,
        head_dim=64,
        scale=0.125,
        kv_pool=Pool(4, 8, 64, torch.float32),
        req_to_token=torch.zeros(1, 4, dtype=torch.int64),
    )
    assert type(create_backend("auto", "cpu", **shape)) is TorchAttentionBackend
    with pytest.raises(ValueError, match="cpu_native"):
        create_backend("cpu_native", "cpu", **shape)


@pytest.mark.parametrize("head_dim", [32, 40, 64, 72])
def test_native_backend_decides_its_prefill_path_at_start(head_dim, monkeypatch):
    """Whether extend runs natively is known when the backend is made (AVX-512 and head_dim % 16 == 0, or
    AVX2 with FMA and head_dim % 8 == 0), so no shape the kernel refuses reaches it in a step (issue 13,
    item 1)."""
    from engine.kernels.attention.cpu_native_backend import CpuNativeAttentionBackend
    from engine.kernels.cpu.build import cpu_flags

    if load_native() is None:
        pytest.skip("no C compiler")
    flags = cpu_flags()
    backend = create_backend(
        "auto",
        "cpu",
        num_heads=8,
        num_kv_heads=2,
        head_dim=head_dim,
        scale=1.0,
        kv_pool=Pool(4, 2, head_dim, torch.float32),
        req_to_token=torch.zeros(1, 4, dtype=torch.int64),
    )
    assert type(backend) is CpuNativeAttentionBackend
    if "avx512f" in flags:
        assert backend.native_extend == (head_dim % 16 == 0)
    else:
        assert backend.native_extend == ("avx2" in flags and "fma" in flags and head_dim % 8 == 0)


def test_native_extend_can_be_switched_off_for_ab_runs(monkeypatch):
    """native_extend=False (the table's native-extend row off): the native backend keeps its decode and
    sends prefill to torch's SDPA."""
    if load_native() is None:
        pytest.skip("no C compiler")
    from engine.kernels.attention.cpu_native_backend import (
        EXTEND,
        CpuNativeAttentionBackend,
        native_support,
    )

    def backend(native_extend: bool = True):
        return create_backend(
            "auto",
            "cpu",
            native_extend,
            num_heads=9,
            num_kv_heads=3,
            head_dim=64,
            scale=1.0,
            kv_pool=Pool(4, 3, 64, torch.float32),
            req_to_token=torch.zeros(1, 4, dtype=torch.int64),
        )

    # the build decides
    assert backend().native_extend == bool(native_support(load_native(), 9, 3, 64) & EXTEND)
    off = backend(
        native_extend(EngineConfig(kernel_overrides={"native-extend": "off"}).kernel_overrides)
    )
    assert type(off) is CpuNativeAttentionBackend and off.native_extend is False


def _scattered_decode_batch(b: int):
    """A decode batch of b requests (contexts 61, 7, 80, 33, 50 in slots 6, 0, 3, 1, 7) whose rows lie
    scattered through a 1,000-row pool: (table, slots, lens, out_cache_loc, batch)."""
    lens, slots = torch.tensor([61, 7, 80, 33, 50])[:b], torch.tensor([6, 0, 3, 1, 7])[:b]
    table = torch.zeros(8, 80, dtype=torch.int64)
    rows = torch.randperm(999)[: int(lens.sum())] + 1
    start = 0
    for s, n in zip(slots.tolist(), lens.tolist()):
        table[s, :n] = rows[start : start + n]
        start += n
    loc = table[slots, lens - 1]
    batch = ForwardBatch(
        ForwardMode.DECODE,
        torch.zeros(b, dtype=torch.long),
        lens - 1,
        loc,
        slots,
        lens,
        int(lens.max()),
        torch.arange(b),
    )
    return table, slots, lens, loc, batch


# the quantized modes' pool; the exact mode's
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b", [5, 1])
def test_native_rows_decoder_stores_and_attends_rows_where_the_projection_wrote_them(b, dtype):
    """The fused decode path's one call (rows_decoder): q, k, v are strided views of one qkv row per
    request; the new K/V land in the pool at out_cache_loc and out equals forward()'s on the same batch."""
    if load_native() is None:
        pytest.fail("no C compiler: the native kernel could not be built on this machine")
    torch.manual_seed(1)
    h, hkv, d = 9, 3, 64
    table, slots, lens, loc, batch = _scattered_decode_batch(b)
    qkv = torch.randn(b, (h + 2 * hkv) * d).to(dtype)
    q, k, v = (x.view(b, -1, d) for x in qkv.split([h * d, hkv * d, hkv * d], -1))
    outs, pools = [], []
    for fused in (False, True):
        pool = Pool(1000, hkv, d, dtype)
        torch.manual_seed(2)
        pool.k_buffers[0].normal_(), pool.v_buffers[0].normal_()  # the same pool both ways
        backend = create_backend(
            "cpu_native",
            "cpu",
            num_heads=h,
            num_kv_heads=hkv,
            head_dim=d,
            scale=d**-0.5,
            kv_pool=pool,
            req_to_token=table,
        )
        backend.init_forward_metadata(batch)
        if fused:
            out = torch.full((b, h, d), float("nan"), dtype=dtype)
            backend.rows_decoder()(
                0, q.data_ptr(), k.data_ptr(), v.data_ptr(), qkv.stride(0), out.data_ptr(), b
            )
        else:
            out = backend.forward(q, k, v, 0, batch)
        outs.append(out)
        pools.append(pool)
    assert torch.equal(outs[1], outs[0])
    assert torch.equal(pools[1].k_buffers[0], pools[0].k_buffers[0]) and torch.equal(
        pools[1].v_buffers[0][loc], v
    )
    half = create_backend(
        "cpu_native",
        "cpu",
        num_heads=h,
        num_kv_heads=hkv,
        head_dim=d,
        scale=d**-0.5,
        kv_pool=Pool(10, hkv, d, torch.float16),
        req_to_token=table,
    )
    assert half.rows_decoder() is None  # the kernel reads float32 or bfloat16 pools only


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b", [5, 1])
def test_native_decode_from_qkv_views_stores_and_attends_in_one_call(b, dtype, monkeypatch):
    """The model's decode hands forward() q, k, v as views of one fused qkv row per request: the native
    backend stores K/V and attends in one C call (no index_put, no copy of q), with the general path's
    pool and output bit for bit."""
    if load_native() is None:
        pytest.fail("no C compiler: the native kernel could not be built on this machine")
    from engine.kernels.attention.torch_backend import TorchAttentionBackend

    torch.manual_seed(3)
    h, hkv, d = 9, 3, 64
    table, slots, lens, loc, batch = _scattered_decode_batch(b)
    qkv = torch.randn(b, (h + 2 * hkv) * d).to(dtype)
    q, k, v = (x.view(b, -1, d) for x in qkv.split([h * d, hkv * d, hkv * d], -1))
    general = TorchAttentionBackend.forward
    calls = []
    monkeypatch.setattr(
        TorchAttentionBackend, "forward", lambda self, *a: calls.append(1) or general(self, *a)
    )
    outs, pools = [], []
    for fused in (False, True):
        pool = Pool(1000, hkv, d, dtype)
        torch.manual_seed(4)
        pool.k_buffers[0].normal_(), pool.v_buffers[0].normal_()  # the same pool both ways
        backend = create_backend(
            "cpu_native",
            "cpu",
            num_heads=h,
            num_kv_heads=hkv,
            head_dim=d,
            scale=d**-0.5,
            kv_pool=pool,
            req_to_token=table,
        )
        backend.init_forward_metadata(batch)
        outs.append(
            backend.forward(q, k, v, 0, batch) if fused else general(backend, q, k, v, 0, batch)
        )
        pools.append(pool)
    assert not calls  # the views took the one call, not the general way
    assert torch.equal(outs[1], outs[0])
    assert torch.equal(pools[1].k_buffers[0], pools[0].k_buffers[0])
    assert torch.equal(pools[1].v_buffers[0], pools[0].v_buffers[0]) and torch.equal(
        pools[1].k_buffers[0][loc], k
    )
    for i in range(b):
        idx = table[slots[i], : lens[i]]
        expected = _reference(q[i], pools[1].k_buffers[0][idx], pools[1].v_buffers[0][idx], d**-0.5)
        tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
        assert torch.allclose(outs[1][i].double(), expected, atol=tol, rtol=tol), f"row {i}"


@pytest.fixture(scope="module")
def attention_build(tmp_path_factory):
    """The attention kernels (decode_attention.c, and extend_avx2.c which it calls) built with the project's
    flags plus narrower ones (-mno-avx512f, ...): the paths a machine without those instructions takes.
    Each flag set compiled once for the module."""
    from helpers import build_narrower
    from engine.kernels.cpu.build import bind_attention

    built = {}

    def get(flags: list[str]):
        if tuple(flags) not in built:
            lib = build_narrower(
                tmp_path_factory.mktemp("narrow"), ["decode_attention.c", "extend_avx2.c"], flags
            )
            built[tuple(flags)] = bind_attention(lib)
        return built[tuple(flags)]

    return get


@pytest.mark.parametrize(
    "narrower",
    [[], ["-mno-avx512bf16"], ["-mno-avx512f"], ["-mno-avx512f", "-mno-avx2"]],
    ids=["native", "no-bf16-dot", "no-avx512", "no-avx2"],
)
# 12/2: six query heads a KV head, blocks of 4 then 2 (AVX2: 3 and 3)
@pytest.mark.parametrize("heads", [(9, 3), (12, 2)])
def test_decode_kernel_builds_match_reference(attention_build, narrower, heads):
    """Each decode path a machine may build (bf16 dot products straight from the pool, bf16 rows converted
    first, 256-bit vectors without AVX-512, the plain loop without AVX2) against the float64 reference,
    over lengths around the 16- and 8-key blocks."""
    lib = attention_build(narrower)
    h, hkv = heads
    d, lens = 64, torch.tensor([1, 7, 15, 16, 17, 33, 80, 131])
    gen = torch.Generator().manual_seed(3)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        k = torch.randn(1200, hkv, d, generator=gen).to(dtype)
        v = torch.randn(1200, hkv, d, generator=gen).to(dtype)
        b = len(lens)
        table = torch.zeros(b, int(lens.max()), dtype=torch.int64)
        rows = torch.randperm(1199, generator=gen)[: int(lens.sum())] + 1
        start = 0
        for i, n in enumerate(lens.tolist()):
            table[i, :n] = rows[start : start + n]
            start += n
        q = torch.randn(b, h, d, generator=gen).to(dtype)
        out = torch.empty_like(q)
        slots = torch.arange(b)
        rc = lib.decode_attention(
            q.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            out.data_ptr(),
            table.data_ptr(),
            table.stride(0),
            slots.data_ptr(),
            lens.data_ptr(),
            b,
            h,
            hkv,
            d,
            d**-0.5,
            int(dtype == torch.bfloat16),
            2,
        )
        assert rc == 0
        for i in range(b):
            idx = table[i, : lens[i]]
            expected = _reference(q[i], k[idx], v[idx], d**-0.5)
            assert torch.allclose(out[i].double(), expected, atol=tol, rtol=tol), (
                dtype,
                i,
                int(lens[i]),
            )
        # fewer requests than threads: KV heads that do not divide among the threads have their sequences
        # split in parts a thread and merged (SPLIT_MIN_LEN, 256 tokens a part; parts empty where a request
        # is shorter than the parts)
        for threads, few in (
            (2, [1100]),
            (2, [513]),
            (2, [511]),
            (3, [800]),
            (4, [5, 1100]),
            (4, [1, 1030]),
        ):
            few_lens = torch.tensor(few)
            q1 = torch.randn(len(few), h, d, generator=gen).to(dtype)
            out1 = torch.full_like(q1, float("nan"))
            slots1 = torch.arange(len(few))
            table1 = torch.stack([torch.randperm(1199, generator=gen)[:1100] + 1 for _ in few])
            rc = lib.decode_attention(
                q1.data_ptr(),
                k.data_ptr(),
                v.data_ptr(),
                out1.data_ptr(),
                table1.data_ptr(),
                table1.stride(0),
                slots1.data_ptr(),
                few_lens.data_ptr(),
                len(few),
                h,
                hkv,
                d,
                d**-0.5,
                int(dtype == torch.bfloat16),
                threads,
            )
            assert rc == 0
            for i, n in enumerate(few):
                expected = _reference(q1[i], k[table1[i, :n]], v[table1[i, :n]], d**-0.5)
                assert torch.allclose(out1[i].double(), expected, atol=tol, rtol=tol), (
                    dtype,
                    threads,
                    few,
                    i,
                )


@pytest.mark.parametrize("narrower", [[], ["-mno-avx512f"]], ids=["native", "no-avx512"])
@pytest.mark.parametrize(
    "head_dim,heads", [(64, (9, 3)), (64, (12, 2)), (40, (6, 2)), (128, (8, 2))]
)
def test_extend_kernel_builds_match_reference(attention_build, narrower, head_dim, heads):
    """Each extend path a machine may build (512-bit; 256-bit without AVX-512, extend_avx2.c) against the
    float64 reference: prefixes and new tokens around the 8- and 16-key blocks and the 32- and 64-key
    softmax steps; a batch of one long prompt, whose queries the AVX2 kernel cuts in ranges across threads;
    head counts of 3, 6 (4 then 2) and 4 a KV head; float32 and bfloat16 storage."""
    lib = attention_build(narrower)
    (h, hkv), d = heads, head_dim
    if not lib.native_support(h, hkv, d) & 2:
        pytest.skip(f"this build has no native extend for head_dim {d}")
    gen = torch.Generator().manual_seed(5)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        k = torch.randn(1500, hkv, d, generator=gen).to(dtype)
        v = torch.randn(1500, hkv, d, generator=gen).to(dtype)
        for prefix_lens, ext_lens in (
            ([0, 3, 0, 31, 8, 40], [1, 5, 8, 2, 9, 33]),
            ([0], [300]),
            ([37], [250]),
        ):
            b = len(ext_lens)
            totals = [p + e for p, e in zip(prefix_lens, ext_lens)]
            table = torch.zeros(b, max(totals), dtype=torch.int64)
            rows = torch.randperm(1499, generator=gen)[: sum(totals)] + 1
            start = 0
            for i, n in enumerate(totals):
                table[i, :n] = rows[start : start + n]
                start += n
            ext = torch.tensor(ext_lens)
            q = torch.randn(int(ext.sum()), h, d, generator=gen).to(dtype)
            out = torch.full_like(q, float("nan"))
            q_start, slots, prefix = (
                torch.cumsum(ext, 0) - ext,
                torch.arange(b),
                torch.tensor(prefix_lens),
            )
            rc = lib.extend_attention(
                q.data_ptr(),
                k.data_ptr(),
                v.data_ptr(),
                out.data_ptr(),
                table.data_ptr(),
                table.stride(0),
                slots.data_ptr(),
                prefix.data_ptr(),
                ext.data_ptr(),
                q_start.data_ptr(),
                b,
                h,
                hkv,
                d,
                d**-0.5,
                int(dtype == torch.bfloat16),
                2,
            )
            assert rc == 0
            for r in range(b):
                for i in range(ext_lens[r]):
                    idx = table[r, : prefix_lens[r] + i + 1]
                    expected = _reference(q[int(q_start[r]) + i], k[idx], v[idx], d**-0.5)
                    got = out[int(q_start[r]) + i].double()
                    assert torch.allclose(got, expected, atol=tol, rtol=tol), (
                        dtype,
                        prefix_lens,
                        r,
                        i,
                    )


@pytest.mark.parametrize("narrower", [[], ["-mno-avx512f"]], ids=["native", "no-avx512"])
def test_extend_query_output_does_not_depend_on_its_batch(attention_build, narrower):
    """The AVX2 kernel takes two query rows at a time (a range's last one alone when odd): a query's output
    must be bitwise the same whether it was paired or alone, i.e. whatever the batch, chunking or thread
    ranges around it. Rows at positions before a block's end (pos % 8 == 7: the paired second row reads a
    block more) and a softmax step's end (pos % 32 == 31: a step more), once paired (one request, two new
    tokens, one thread: its 3 KV heads are then not cut in query ranges, which would part the two rows) and
    once alone (two requests over the same rows, one new token each)."""
    lib = attention_build(narrower)
    h, hkv, d = 9, 3, 64
    gen = torch.Generator().manual_seed(11)
    for dtype in (torch.float32, torch.bfloat16):
        k = torch.randn(100, hkv, d, generator=gen).to(dtype)
        v = torch.randn(100, hkv, d, generator=gen).to(dtype)
        for pos in (0, 10, 15, 31, 63, 70):
            q = torch.randn(2, h, d, generator=gen).to(dtype)
            rows = torch.randperm(99, generator=gen)[: pos + 2] + 1
            table = rows.repeat(2, 1).contiguous()
            outs = []
            for prefix, ext, q_start in (([pos], [2], [0]), ([pos, pos + 1], [1, 1], [0, 1])):
                out = torch.full_like(q, float("nan"))
                n = len(ext)
                slots, prefix, ext, q_start = (
                    torch.arange(n),
                    torch.tensor(prefix),
                    torch.tensor(ext),
                    torch.tensor(q_start),
                )
                rc = lib.extend_attention(
                    q.data_ptr(),
                    k.data_ptr(),
                    v.data_ptr(),
                    out.data_ptr(),
                    table.data_ptr(),
                    table.stride(0),
                    slots.data_ptr(),
                    prefix.data_ptr(),
                    ext.data_ptr(),
                    q_start.data_ptr(),
                    n,
                    h,
                    hkv,
                    d,
                    d**-0.5,
                    int(dtype == torch.bfloat16),
                    1,
                )
                assert rc == 0
                outs.append(out)
            assert torch.equal(outs[0], outs[1]), (dtype, pos)


# bfloat16: the whole-step pass (AVX512_BF16)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_extend_whole_softmax_steps_add_scores_as_single_blocks_do(dtype):
    """The extend kernel scores a whole online-softmax step (4 blocks of 16 keys) in one pass over the query
    and a partial last step block by block: a query's output must not depend on which of the two its keys
    fall in. Keys 48..63 are made to weigh nothing (their scores sit hundreds below the others': exp gives 0
    or float32's underflow floor, which no sum here can show), so a query at position 63 (one whole step)
    and the same query at 47 (a partial step of 3 blocks) attend the same keys: bitwise equal outputs, for
    64 random queries. (Both passes add each score's products in the same order, even and odd pairs of
    dimensions apart: the kernel's outputs are bitwise those of its block-by-block version.)"""
    lib = load_native()
    if lib is None:
        pytest.fail("no C compiler: the native kernel could not be built on this machine")
    if not lib.native_support(9, 3, 64) & 2:
        pytest.skip(
            "this build has no native extend (it needs AVX-512, or AVX2 with FMA): torch's prefill runs instead"
        )
    h, hkv, d, n = 9, 3, 64, 64
    gen = torch.Generator().manual_seed(7)
    # positive; each query twice
    q = (torch.rand(n, h, d, generator=gen) + 0.5).to(dtype).repeat(2, 1, 1)
    k = torch.randn(64, hkv, d, generator=gen)
    k[48:] = -50.0
    k, v = k.to(dtype), torch.randn(64, hkv, d, generator=gen).to(dtype)
    table = torch.arange(64, dtype=torch.int64).repeat(2 * n, 1).contiguous()
    out = torch.full_like(q, float("nan"))
    prefix = torch.tensor([47] * n + [63] * n)  # one new token each: the query at 47, then at 63
    ext, q_start, slots = (
        torch.ones(2 * n, dtype=torch.int64),
        torch.arange(2 * n),
        torch.arange(2 * n),
    )
    rc = lib.extend_attention(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        out.data_ptr(),
        table.data_ptr(),
        table.stride(0),
        slots.data_ptr(),
        prefix.data_ptr(),
        ext.data_ptr(),
        q_start.data_ptr(),
        2 * n,
        h,
        hkv,
        d,
        d**-0.5,
        int(dtype == torch.bfloat16),
        2,
    )
    assert rc == 0
    for i in (0, n - 1):  # the keys past 47 really weigh nothing: the live keys' reference
        assert torch.allclose(
            out[i].double(), _reference(q[i], k[:48], v[:48], d**-0.5), atol=3e-2, rtol=3e-2
        )
    assert torch.equal(out[:n], out[n:])


def test_the_elementwise_ops_never_read_past_a_tensor_given_the_wrong_shape():
    """The native paths checked dtype, device and contiguity, not shapes: a delta of one row for four,
    cos/sin of one position for four tokens, or a weight shorter than a row were read past their ends
    (garbage out where torch broadcasts or raises). Now such calls take torch's path: its answer or its
    error."""
    from engine.kernels import ops

    if load_native() is None:
        pytest.fail("no C compiler: the native kernel could not be built on this machine")
    g = torch.Generator().manual_seed(0)
    h, delta, w = (
        torch.randn(4, 8, generator=g),
        torch.randn(1, 8, generator=g),
        torch.randn(8, generator=g),
    )
    summed, normed = ops.add_rms_norm(h.clone(), delta, w, 1e-6)
    assert torch.equal(summed, h + delta)
    torch.testing.assert_close(normed, ops.rms_norm(h + delta, w, 1e-6))
    with pytest.raises(RuntimeError):
        ops.rms_norm(torch.randn(2, 8, generator=g), torch.randn(4, generator=g), 1e-6)
    heads, kv_heads, d, t = 2, 1, 8, 4
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g)
    cos, sin = torch.randn(1, d, generator=g), torch.randn(1, d, generator=g)
    q, k, v = ops.rotate_qkv(qkv.clone(), cos, sin, heads, kv_heads, d)
    q_ref, k_ref = ops.apply_rotary(
        qkv[:, : heads * d].view(t, heads, d),
        qkv[:, heads * d : (heads + 1) * d].view(t, 1, d),
        cos,
        sin,
    )
    torch.testing.assert_close(q, q_ref)
    torch.testing.assert_close(k, k_ref)
    with pytest.raises(RuntimeError):
        ops.silu_and_mul(torch.randn(3, 9, generator=g))
