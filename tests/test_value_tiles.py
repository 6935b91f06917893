"""The value codes in 64-row tiles (kvstore's value_layout "tiles"): where each half lands, and every writer and
reader of the store (the torch reference, the Triton write and decode kernels through Triton's interpreter, the
Gluon programs on a GPU) giving what it gives with the row layout."""

import contextlib
import dataclasses

import pytest
import torch

pytest.importorskip("triton")

# The kernel modules as test_triton_kernels prepares them (through Triton's interpreter where there is no GPU).
from test_triton_kernels import DEVICE, decode, variant, write  # noqa: E402

from oscar_core import kvstore  # noqa: E402


def test_tile_slots_put_each_half_where_the_docstring_says():
    """Row 64k + m's half h at 16-bit slot 64h + 16·(m div 16) + 2·(m mod 8) + (m mod 16) div 8 of tile k, its
    bytes in order; rows 16i + j and 16i + 8 + j side by side."""
    m = torch.arange(64)
    slots = kvstore.tile_slot(m)
    assert sorted(slots.tolist()) == list(range(64))
    assert slots[16 * 2 + 3] + 1 == slots[16 * 2 + 8 + 3]
    d, rows = 128, torch.tensor([0, 5, 63, 64, 100, 191])
    cache = kvstore.empty_cache(2, 3, d, 700, value_layout="tiles")
    packed = torch.randint(0, 256, (3, len(rows), d // 4), dtype=torch.uint8)
    kvstore.put_value_rows(cache, 1, rows, packed)
    halves = cache.value_codes[1].reshape(3, -1, 64 * d // 4).view(torch.int16)
    for i, r in enumerate(rows.tolist()):
        for h in range(d // 8):
            lo, hi = packed[:, i, 2 * h].int(), packed[:, i, 2 * h + 1].int()
            got = halves[:, r // 64, 64 * h + int(kvstore.tile_slot(torch.tensor(r % 64)))].int() & 0xFFFF
            assert torch.equal(got, lo | (hi << 8))
    assert torch.equal(kvstore.value_rows(cache, 1, rows), packed)
    assert cache.value_codes[0].count_nonzero() == 0
    with pytest.raises(ValueError, match="value_layout"):
        kvstore.empty_cache(1, 1, 64, 100, value_layout="columns")


def logical_values(cache, b):
    return kvstore.value_rows(cache, b, torch.arange(cache.value_codes.shape[2], device=cache.value_codes.device))


def assert_same_store(tiles, rows):
    """The same stored content: value codes row by row, every other tensor byte for byte."""
    for b in range(rows.value_codes.shape[0]):
        assert torch.equal(logical_values(tiles, b), rows.value_codes[b])
    for name in ("key_codes", "key_scale", "key_zero", "value_scale", "value_zero", "key_sink", "value_sink",
                 "key_recent", "value_recent", "lengths"):
        assert torch.equal(getattr(tiles, name), getattr(rows, name)), name


def layer_of(gen, heads, d):
    mk, mv = torch.randn(heads, d, generator=gen), torch.randn(heads, d, generator=gen)
    rot = [torch.linalg.qr(torch.randn(heads, d, d, generator=gen, dtype=torch.float64))[0].float() for _ in "kv"]
    return kvstore.LayerRotation(rot[0], rot[1], torch.full((heads,), 0.96), torch.full((heads,), 0.92), mk, mv)


@pytest.mark.parametrize("axis", ["token", "channel"])
def test_reference_store_reads_the_same_in_both_layouts(axis):
    """kvstore.prefill then append_token, rows against tiles: the same codes row by row, the same keys and
    values read back (sequence_kv) and the same attention."""
    gen = torch.Generator().manual_seed(3)
    heads, d, lengths = 2, 64, [300, 97, 1]
    layer = layer_of(gen, heads, d)
    keys = torch.randn(3, 300, heads, d, generator=gen).bfloat16()
    values = torch.randn(3, 300, heads, d, generator=gen).bfloat16()
    stores = [kvstore.empty_cache(3, heads, d, 420, sink_tokens=16, recent_tokens=32, key_axis=axis, value_layout=v)
              for v in ("rows", "tiles")]
    steps = [torch.randn(3, heads, d, generator=gen).bfloat16() for _ in range(2 * 40)]
    for cache in stores:
        kvstore.prefill(cache, keys, values, torch.tensor(lengths), layer)
        for i in range(40):
            kvstore.append_token(cache, steps[2 * i], steps[2 * i + 1], layer)
    rows, tiles = stores
    assert rows.int2_tokens().tolist()[0] >= 64 * 4
    assert_same_store(tiles, rows)
    assert not torch.equal(tiles.value_codes, rows.value_codes)
    for b in range(3):
        for a, c in zip(kvstore.sequence_kv(tiles, b), kvstore.sequence_kv(rows, b)):
            assert torch.equal(a, c)
    q = torch.randn(3, 2 * heads, d, generator=gen)
    outs = [kvstore.decode_attention_reference(q, c, layer.key_rotation, layer.value_rotation, layer.value_mean,
                                               d ** -0.5) for c in stores]
    assert torch.equal(outs[0], outs[1])


def on_device(layer):
    return {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in vars(layer).items()}


@pytest.mark.parametrize("axis", ["token", "channel"])
def test_triton_writes_and_reads_tiles_as_rows(axis):
    """prefill_kv, then decode steps through leave_blocks / append_kv, into a store of each layout: the same
    content row by row; decode_attention over them: the same outputs, bit for bit."""
    gen = torch.Generator().manual_seed(5)
    heads, d, lengths = 2, 64, [200, 70]
    layer = layer_of(gen, heads, d)
    on = on_device(layer)
    kr = write.prepare_rotation(on["key_rotation"], on["key_mean"])
    vr = write.prepare_rotation(on["value_rotation"], on["value_mean"])
    n = max(lengths)
    keys = torch.randn(2, heads, n, d, generator=gen).bfloat16().to(DEVICE)
    values = torch.randn(2, heads, n, d, generator=gen).bfloat16().to(DEVICE)
    steps = [torch.randn(2, heads, 1, d, generator=gen).bfloat16().to(DEVICE) for _ in range(2 * 8)]
    stores = []
    for layout in ("rows", "tiles"):
        cache = kvstore.empty_cache(2, heads, d, 300, sink_tokens=16, recent_tokens=32, device=DEVICE, key_axis=axis,
                                    value_layout=layout)
        cache.lengths.copy_(torch.tensor(lengths))
        write.prefill_kv(cache, keys, values, kr, vr, on["key_clip"], on["value_clip"])
        for i in range(8):
            kvstore.advance(cache, 1)
            if axis == "channel":
                write.leave_blocks(cache, on["key_clip"], on["value_clip"], 1)
            write.append_kv(cache, steps[2 * i], steps[2 * i + 1], kr, vr, on["key_clip"], on["value_clip"],
                            evict=axis == "token")
        stores.append(cache)
    rows, tiles = stores
    assert int(rows.int2_tokens()[0]) >= 128
    assert_same_store(tiles, rows)
    q = torch.randn(2, 4 * heads, d, generator=gen).to(DEVICE)
    outs = [decode.decode_attention(q, c, on["key_rotation"], on["value_rotation"], on["value_mean"], d ** -0.5,
                                    variant(q, c, block_n=32)) for c in stores]
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Gluon programs need a GPU")
@pytest.mark.parametrize("d,heads,kv_heads,group,axis", [
    (128, 8, 2, 64, "token"), (128, 8, 2, 64, "channel"), (128, 16, 2, 64, "token"), (128, 16, 2, 64, "channel"),
    (128, 32, 2, 128, "token"), (64, 14, 2, 64, "channel"), (64, 8, 2, 64, "token"), (256, 4, 1, 64, "token"),
    (256, 8, 2, 64, "channel"), (256, 4, 2, 128, "token"),
])
def test_gluon_programs_read_tiles_as_rows(d, heads, kv_heads, group, axis):
    """The Gluon programs over a store of each layout (the same content, prefilled by the reference): within 1e-2 of
    the reference, and the same outputs bit for bit when the rows are read by the tile program's settings but its
    layout (the default settings of the two layouts may differ in where they mask, whether they load keys a tile
    ahead and which tiles a split takes, which can move a last bit: plan.mask_every_tile, plan.keys_ahead,
    plan.strided_tiles)."""
    gen = torch.Generator().manual_seed(d + heads)
    lengths = [1500, 321, 64]
    layer = layer_of(gen, kv_heads, d)
    keys = torch.randn(3, max(lengths), kv_heads, d, generator=gen).bfloat16()
    values = (torch.randn(3, max(lengths), kv_heads, d, generator=gen) + layer.value_mean).bfloat16()
    stores = []
    for layout in ("rows", "tiles"):
        cache = kvstore.empty_cache(3, kv_heads, d, 1600, group, group, 16, 32, key_axis=axis, value_layout=layout)
        kvstore.prefill(cache, keys, values, torch.tensor(lengths), layer)
        stores.append(kvstore.to_device(cache, "cuda"))
    q = torch.randn(3, heads, d, generator=gen)
    ref = kvstore.decode_attention_reference(q, cache, layer.key_rotation, layer.value_rotation, layer.value_mean,
                                             d ** -0.5)
    on = on_device(layer)

    def run(cache, plan):
        return decode.decode_attention(q.cuda(), cache, on["key_rotation"], on["value_rotation"], on["value_mean"],
                                       d ** -0.5, plan, graph=False)

    plans = [decode.plan_for(q.cuda(), c, gluon=True) for c in stores]
    outs = [run(c, p) for c, p in zip(stores, plans)]
    assert decode.shape_of(q.cuda(), stores[1]).value_tiles and not decode.shape_of(q.cuda(), stores[0]).value_tiles
    for out in outs:
        err = (out.cpu().float() - ref).norm(dim=-1) / ref.norm(dim=-1)
        assert err.max() < 1e-2, err
    tiles = plans[1]
    rows = dataclasses.replace(plans[0], mask_all=tiles.mask_all, keys_ahead=tiles.keys_ahead, strided=tiles.strided)
    assert torch.equal(run(stores[0], rows), outs[1])


@pytest.mark.parametrize("kernel", [False, True])
def test_oscar_cache_decodes_the_same_with_tiles(kernel):
    """OscarCache(value_layout="tiles") through a model's decode steps (torch writes and reads, or the Triton
    kernels'): the same logits as rows, bit for bit, with stores that grow past their first capacity."""
    from test_cache_kernel import LAYERS, decode_logits, random_bundle, tiny_llama

    from oscar_core.errors import OscarError
    from oscar_core.serve.cache import OscarCache, oscar_attention

    model = tiny_llama()
    bundle = random_bundle(4, 16, channel_layers=(1,))
    ids = torch.randint(0, 256, (2, 100), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    logits = []
    for layout in kvstore.VALUE_LAYOUTS:
        cache = OscarCache(bundle, "oscar", num_layers=LAYERS, sink_tokens=4, recent_tokens=16, kernel_reads=kernel,
                           kernel_writes=kernel, capacity=102, value_layout=layout)
        with oscar_attention(model, cache) if kernel else contextlib.nullcontext():
            logits.append(decode_logits(model, cache, ids, steps=5))
        assert all(layer.store.value_layout == layout for layer in cache.kv_layers)
        assert cache.kv_layers[0].store.key_codes.shape[2] > kvstore.int2_rows(102, 4, 16)      # grown
    assert torch.equal(logits[0], logits[1])
    with pytest.raises(OscarError, match="value_layout"):
        OscarCache(bundle, "oscar", num_layers=LAYERS, value_layout="columns")
