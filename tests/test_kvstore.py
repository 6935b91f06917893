import pytest
import torch

from oscar_core import kvstore, quant

S, W = kvstore.SINK_TOKENS, kvstore.RECENT_TOKENS


def orthogonal(heads, d, gen):
    return torch.linalg.qr(torch.randn(heads, d, d, generator=gen, dtype=torch.float64))[0].float()


def make_layer(kv_heads, d, gen):
    return kvstore.LayerRotation(
        key_rotation=orthogonal(kv_heads, d, gen), value_rotation=orthogonal(kv_heads, d, gen),
        key_clip=torch.full((kv_heads,), 0.96), value_clip=torch.full((kv_heads,), 0.92),
        key_mean=torch.randn(kv_heads, d, generator=gen), value_mean=torch.randn(kv_heads, d, generator=gen))


def test_write_read_roundtrip():
    gen = torch.Generator().manual_seed(1)
    heads, d = 3, 128
    x = torch.randn(50, heads, d, generator=gen).bfloat16()
    rot, mean = orthogonal(heads, d, gen), torch.randn(heads, d, generator=gen)
    clip = torch.tensor([1.0, 0.9, 0.8])
    packed, scale, zero = kvstore.write_int2(x, rot, clip, 64, mean)
    assert packed.shape == (50, heads, d // 4) and packed.dtype == torch.uint8
    assert scale.shape == zero.shape == (50, heads, 2) and zero.dtype == torch.int8
    back = kvstore.read_int2(packed, scale, zero, 64)
    y = kvstore.rotate(x, rot, mean)
    codes, scale_ref, zero_ref = quant.quantize(y, 64, clip[None, :])  # integer codes: exact
    assert torch.equal(quant.unpack_int2(packed), codes) and torch.equal(scale, scale_ref) and torch.equal(zero, zero_ref)
    torch.testing.assert_close(back, quant.fake_quantize(y, 64, clip[None, :]), rtol=1e-6, atol=0)
    original = torch.einsum("the,hde->thd", back, rot) + mean
    assert torch.allclose(kvstore.rotate(original, rot, mean), back, atol=1e-4)
    assert (back - y).norm() / y.norm() < 0.7  # INT2 of Gaussian data, clipped


def original_space_attention(q, cache, layer, scaling):
    """float64: every position of every sequence rebuilt in original space, then plain softmax attention."""
    bsz, heads, d = q.shape
    kv_heads = layer.key_rotation.shape[0]
    out = torch.empty(bsz, heads, d, dtype=torch.float64)
    for b in range(bsz):
        n = int(cache.lengths[b])
        keys, values = [], []
        for p in range(n):
            if p < S:
                k, v = cache.key_sink[b, :, p], cache.value_sink[b, :, p]
            elif p >= n - W:
                k, v = cache.key_recent[b, :, (p - S) % W], cache.value_recent[b, :, (p - S) % W]
            else:
                r = p - S
                k = quant.dequantize(quant.unpack_int2(cache.key_codes[b, :, r]), cache.key_scale[b, :, r],
                                     cache.key_zero[b, :, r], cache.key_group_size)
                codes = kvstore.value_rows(cache, b, torch.tensor([r]))[:, 0]
                v = quant.dequantize(quant.unpack_int2(codes), cache.value_scale[b, :, r],
                                     cache.value_zero[b, :, r], cache.value_group_size)
            keys.append(k.double())
            values.append(v.double())
        rk, rv = layer.key_rotation.double(), layer.value_rotation.double()
        k = torch.einsum("thc,hdc->thd", torch.stack(keys), rk) + layer.key_mean.double()
        v = torch.einsum("thc,hdc->thd", torch.stack(values), rv) + layer.value_mean.double()
        for j in range(heads):
            h = j // (heads // kv_heads)
            p = torch.softmax(scaling * k[:, h] @ q[b, j].double(), dim=0)
            out[b, j] = p @ v[:, h]
    return out


def test_decode_reference_matches_float64_original_space():
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, d = 8, 2, 64
    layer = make_layer(kv_heads, d, gen)
    lengths = torch.tensor([500, 40, 330, 64, 321])
    keys = torch.randn(5, 500, kv_heads, d, generator=gen).bfloat16()
    values = torch.randn(5, 500, kv_heads, d, generator=gen).bfloat16()
    cache = kvstore.empty_cache(5, kv_heads, d, 600)
    kvstore.prefill(cache, keys, values, lengths, layer)
    assert cache.int2_tokens().tolist() == [180, 0, 10, 0, 1]
    q = torch.randn(5, heads, d, generator=gen)
    ref = kvstore.decode_attention_reference(q, cache, layer.key_rotation, layer.value_rotation,
                                             layer.value_mean, d ** -0.5)
    exact = original_space_attention(q, cache, layer, d ** -0.5)
    assert ((ref.double() - exact).norm() / exact.norm()) < 1e-5


def test_windows_keep_bf16_rotation():
    gen = torch.Generator().manual_seed(3)
    kv_heads, d = 2, 64
    layer = make_layer(kv_heads, d, gen)
    keys = torch.randn(1, 400, kv_heads, d, generator=gen).bfloat16()
    cache = kvstore.empty_cache(1, kv_heads, d, 400)
    kvstore.prefill(cache, keys, keys, torch.tensor([400]), layer)
    y = kvstore.rotate(keys[0], layer.key_rotation, layer.key_mean).bfloat16()
    assert torch.equal(cache.key_sink[0], y[:S].transpose(0, 1))
    assert torch.equal(cache.key_recent[0, :, (399 - S) % W], y[399])
    packed, _, _ = kvstore.write_int2(keys[0, S:400 - W], layer.key_rotation, layer.key_clip, 64, layer.key_mean)
    assert torch.equal(cache.key_codes[0, :, :400 - S - W], packed.transpose(0, 1))


def test_append_token_matches_prefill():
    gen = torch.Generator().manual_seed(4)
    kv_heads, d = 2, 64
    layer = make_layer(kv_heads, d, gen)
    n = S + W + 40
    keys = torch.randn(2, n, kv_heads, d, generator=gen).bfloat16()
    values = torch.randn(2, n, kv_heads, d, generator=gen).bfloat16()
    full = kvstore.empty_cache(2, kv_heads, d, n)
    kvstore.prefill(full, keys, values, torch.tensor([n, n]), layer)
    grown = kvstore.empty_cache(2, kv_heads, d, n)
    kvstore.prefill(grown, keys[:, :300], values[:, :300], torch.tensor([300, 300]), layer)
    for t in range(300, n):
        kvstore.append_token(grown, keys[:, t], values[:, t], layer)
    assert grown.lengths.tolist() == [n, n]
    # The BF16 windows hold the same float32 rotation, computed on differently shaped matmuls: equal up
    # to the rounding of the last float32 bits into bf16 (one bf16 step, rarely).
    for a, b in ((grown.key_sink, full.key_sink), (grown.value_recent, full.value_recent)):
        assert torch.allclose(a.float(), b.float(), rtol=2 ** -7, atol=0)
        assert (a == b).float().mean() > 0.99
    # Evicted tokens are quantized from their BF16 copy, prefilled ones from float32: nearly the same codes.
    rows = n - S - W
    same = quant.unpack_int2(grown.key_codes[:, :, :rows]) == quant.unpack_int2(full.key_codes[:, :, :rows])
    assert same.float().mean() > 0.95
    assert (grown.value_scale[:, :, :rows] == full.value_scale[:, :, :rows]).float().mean() > 0.95


def channel_sides(layer, key_group, value_group):
    """The methods.Sides of a layer whose keys are quantized per channel over blocks of key_group tokens."""
    from oscar_core.serve import methods

    return (methods.Side(key_group, "channel", layer.key_rotation, layer.key_mean, layer.key_clip),
            methods.Side(value_group, "token", layer.value_rotation, layer.value_mean, layer.value_clip))


def cache_view(x, side, block, s, w):
    """x [H_kv, n, d] as a cache reads it for the query at position n − 1 (simulate's rule)."""
    from oscar_core.serve import methods

    n = x.shape[1]
    int2 = methods.int2_mask(torch.tensor([n - 1]), n, side, s, w, block)[0][:, None]
    return torch.where(int2, torch.cat([x[:, :s], methods.fake(side, x[:, s:])], dim=1), x)


def unrotate(y, rotation, mean):
    x = torch.einsum("hte,hde->htd", y, rotation)
    return x if mean is None else x + mean[:, None]


def test_channel_keys_prefill_reads_as_methods():
    """Prefill of a ragged batch: whole key blocks past the window are methods.encode's per-channel groups."""
    gen = torch.Generator().manual_seed(11)
    kv_heads, d, g, s, w = 2, 64, 8, 4, 16
    layer = make_layer(kv_heads, d, gen)
    ks, vs = channel_sides(layer, g, 64)
    lengths = [100, 3, 20, 21, 28, 29, 45]
    keys = torch.randn(len(lengths), 100, kv_heads, d, generator=gen).bfloat16()
    values = torch.randn(len(lengths), 100, kv_heads, d, generator=gen).bfloat16()
    cache = kvstore.empty_cache(len(lengths), kv_heads, d, 100, g, 64, s, w, key_axis="channel")
    assert cache.key_recent.shape[2] == w + g and cache.key_scale.shape[2:] == (cache.key_codes.shape[2] // g, d)
    kvstore.prefill(cache, keys, values, torch.tensor(lengths), layer)
    assert cache.int2_tokens().tolist() == [80, 0, 0, 0, 8, 8, 24]
    for b, n in enumerate(lengths):
        k, v = kvstore.sequence_kv(cache, b)
        got_k = unrotate(k, layer.key_rotation, layer.key_mean)
        got_v = unrotate(v, layer.value_rotation, layer.value_mean)
        for got, x, side in ((got_k, keys[b, :n], ks), (got_v, values[b, :n], vs)):
            want = cache_view(x.transpose(0, 1).float(), side, g, s, w)
            # INT2 rows quantize the float32 rotation (as methods does); windows hold it rounded to bf16.
            assert torch.isclose(got, want, atol=3e-2).all()
            int2 = slice(s, s + int(cache.int2_tokens()[b]))
            assert torch.isclose(got[:, int2], want[:, int2], atol=1e-4).float().mean(dim=(0, 2)).min(0).values > 0.99 \
                if int2.stop > s else True


def test_channel_keys_append_reads_as_simulation():
    """Token-by-token and chunked appends with left pads across several block boundaries: after every append
    each sequence reads what simulate gives its last position (identity rotation, so the BF16 ring copy that
    a leaving block is quantized from is the token itself), and the reference attention is the simulation's."""
    from oscar_core.serve import methods
    from oscar_core.serve.simulate import simulated_attention

    gen = torch.Generator().manual_seed(12)
    bsz, kv_heads, heads, d, g, s, w = 3, 2, 4, 64, 8, 4, 16
    eye = torch.eye(d).expand(kv_heads, d, d)
    layer = kvstore.LayerRotation(eye, eye, torch.tensor([0.96, 0.9]), torch.tensor([0.92, 1.0]))
    ks, vs = channel_sides(layer, g, 32)
    lm = methods.LayerMethod(ks, vs)
    cache = kvstore.empty_cache(bsz, kv_heads, d, 120, g, 32, s, w, key_axis="channel")
    seqs = [torch.zeros(2, kv_heads, 0, d) for _ in range(bsz)]
    q = torch.randn(bsz, heads, d, generator=gen)

    def append(n, starts=None):
        k = (torch.randn(bsz, kv_heads, n, d, generator=gen) * 2).bfloat16()
        v = torch.randn(bsz, kv_heads, n, d, generator=gen).bfloat16()
        kvstore.advance(cache, n, starts)
        kvstore.append(cache, k, v, layer, starts)
        for b in range(bsz):
            st = 0 if starts is None else int(starts[b])
            seqs[b] = torch.cat([seqs[b], torch.stack([k[b, :, st:], v[b, :, st:]]).float()], dim=2)
        ref = kvstore.decode_attention_reference(q, cache, layer.key_rotation, layer.value_rotation, None, 0.125)
        for b in range(bsz):
            x = seqs[b]
            assert int(cache.lengths[b]) == x.shape[2]
            k_got, v_got = kvstore.sequence_kv(cache, b)
            assert torch.allclose(k_got, cache_view(x[0], ks, g, s, w), atol=1e-5)
            assert torch.allclose(v_got, cache_view(x[1], vs, g, s, w), atol=1e-5)
            sim = simulated_attention(q[b, :, None][None], x[0][None], x[1][None], lm, 0.125, s, w)
            assert torch.allclose(ref[b], sim[0, :, 0], atol=1e-5)

    append(13, torch.tensor([0, 4, 12], dtype=torch.int32))
    for _ in range(30):
        append(1)
    append(21, torch.tensor([0, 3, 0], dtype=torch.int32))   # longer than the window: blocks straight to INT2
    append(5)
    assert cache.lengths.tolist() == [69, 62, 57] and cache.int2_tokens().tolist() == [48, 40, 32]


def test_channel_keys_store_bytes():
    cache = kvstore.empty_cache(2, 3, 64, 500, 64, 64, 64, 256, key_axis="channel")
    held = kvstore.allocation_nbytes(t for t in vars(cache).values() if isinstance(t, torch.Tensor))
    assert held == kvstore.store_nbytes(2, 500, 3, 64, 64, 64, 64, 256, key_axis="channel")
    assert cache.recent_tokens == 256 and cache.ring_slots == 320 and cache.key_codes.shape[2] % 64 == 0


@pytest.mark.parametrize("axis", ["token", "channel"])
def test_window_store_holds_the_last_n_tokens(axis):
    """A window's store (a sink of 4, a BF16 ring of W, a ring of T INT2 rows, T + W = N) reads back exactly the last
    N tokens of a store that keeps every token with the same sink and ring, through prefills longer than N, decode
    steps and chunks that wrap its rows (its sink tokens skipped once out of the window); the rows are whole tiles
    (and key blocks), the ring what is left. Keys per channel (blocks of 16): the rows hold up to 15 older tokens of
    the oldest block, which reads skip."""
    gen = torch.Generator().manual_seed(4)
    layer = make_layer(2, 64, gen)
    assert kvstore.window_split(1024) == (768, 256) and kvstore.window_split(300, 40) == (256, 44)
    assert kvstore.window_split(100, 40)[0] == 0 and kvstore.window_split(1024, 256, 128) == (768, 256)
    assert kvstore.window_split(1000, 256, 128) == (640, 360)
    kw = dict(key_group_size=16, key_axis="channel") if axis == "channel" else {}
    win = kvstore.window_cache(2, 2, 64, 300, sink_tokens=4, recent_tokens=40, **kw)
    full = kvstore.empty_cache(2, 2, 64, 2000, sink_tokens=4, recent_tokens=win.recent_tokens, **kw)
    assert (win.sink_tokens, win.recent_tokens, win.key_codes.shape[2]) == (4, 44, 256)
    assert_holds_last_tokens(win, full, layer, gen, [2, 1, 280, 1, 20, 500, 1, 37, 1, 300, 129] + [1] * 20)
    assert win.int2_tokens().tolist() == [256, 256]


def assert_holds_last_tokens(win, full, layer, gen, chunks):
    """Append the same random chunks to a window's store and a full store: after each, every sequence of the window's
    store reads back exactly the full store's last N tokens."""
    length, n_win = 0, win.window
    for n in chunks:
        k, v = (torch.randn(2, 2, n, 64, generator=gen) for _ in range(2))
        for store in (win, full):
            kvstore.advance(store, n)
            kvstore.append(store, k, v, layer)
        length += n
        for b in range(2):
            got, want = kvstore.sequence_kv(win, b), kvstore.sequence_kv(full, b)
            assert got[0].shape[1] == min(length, n_win)
            assert torch.equal(got[0], want[0][:, -n_win:]) and torch.equal(got[1], want[1][:, -n_win:])


def test_bf16_window_store_holds_the_last_n_tokens():
    """A window kept whole in BF16 (window_cache(int2=False): the sink and a ring of N, no INT2 rows) reads back the
    last N tokens of a store that keeps every token in BF16, through prefills longer than N, steps and chunks."""
    gen = torch.Generator().manual_seed(5)
    layer = make_layer(2, 64, gen)
    win = kvstore.window_cache(2, 2, 64, 40, sink_tokens=4, recent_tokens=40, int2=False)
    assert (win.sink_tokens, win.recent_tokens, win.key_codes.shape[2], win.window) == (4, 40, 0, 40)
    full = kvstore.empty_cache(2, 2, 64, 4 + 400, sink_tokens=4, recent_tokens=400)
    assert_holds_last_tokens(win, full, layer, gen, [2, 1, 70, 1, 20, 50, 1, 39, 1] + [1] * 45)
    assert win.int2_tokens().tolist() == [0, 0]
    with pytest.raises(ValueError, match="key_axis"):
        kvstore.window_cache(1, 1, 64, 40, key_group_size=16, key_axis="channel", int2=False)
