"""GPU check and timing of keys per channel (kvstore key_axis "channel", blocks of G tokens).

1. decode_attention on channel stores against kvstore's reference: G = 64 and 128, head_dim 64/128/256,
   1-8 query heads per KV head, ragged batches, both score orientations, fused and not (the data of
   decode_check.py, so the errors compare with the per-token figures);
2. leave_blocks + append_kv against kvstore.append over decode steps that cross block boundaries;
3. at the Qwen3-8B shape (32 query / 8 KV heads, d = 128) the time of one decode attention over a channel
   store against a per-token store (default programs: Gluon where they serve; and the Triton programs).
For a bare GPU image (no pytest); exits non-zero if an error exceeds 1e-2 or a code differs by more than 1:
    PYTHONPATH=. python3 bench/channel_check.py
"""

import sys

import torch
from triton.testing import do_bench

from oscar_core import kvstore, quant
from oscar_core.triton import decode, write

CASES = [  # (heads, kv_heads, d, G, G_V, lengths, sink, recent)
    (8, 2, 128, 64, 64, [900, 321, 64, 65], 16, 32),
    (4, 4, 64, 64, 64, [1, 40, 600, 7], 16, 32),
    (16, 2, 128, 128, 64, [5000, 3000], 64, 256),
    (8, 1, 256, 64, 64, [700, 90], 16, 32),
    (32, 8, 128, 64, 64, [20_000, 7], 64, 256),
]


def orthogonal(heads, d, gen):
    return torch.linalg.qr(torch.randn(heads, d, d, generator=gen, dtype=torch.float64))[0].float().cuda()


def layer_of(gen, kv_heads, d):
    return kvstore.LayerRotation(orthogonal(kv_heads, d, gen), orthogonal(kv_heads, d, gen),
                                 torch.full((kv_heads,), 0.96, device="cuda"),
                                 torch.full((kv_heads,), 0.92, device="cuda"),
                                 torch.randn(kv_heads, d, generator=gen).cuda(),
                                 torch.randn(kv_heads, d, generator=gen).cuda())


def check_decode(gen) -> float:
    worst = 0.0
    for heads, kv_heads, d, g, gv, lengths, sink, recent in CASES:
        layer = layer_of(gen, kv_heads, d)
        bsz, longest = len(lengths), max(lengths)
        keys = (torch.randn(bsz, longest, kv_heads, d, generator=gen).cuda() + layer.key_mean).bfloat16()
        values = (torch.randn(bsz, longest, kv_heads, d, generator=gen).cuda() + layer.value_mean).bfloat16()
        cache = kvstore.empty_cache(bsz, kv_heads, d, longest, g, gv, sink, recent, device="cuda", key_axis="channel")
        kvstore.prefill(cache, keys, values, torch.tensor(lengths, device="cuda"), layer)
        q = torch.randn(bsz, heads, d, generator=gen).bfloat16().cuda()
        for mean in (layer.value_mean, None):
            ref = kvstore.decode_attention_reference(q, cache, layer.key_rotation, layer.value_rotation, mean,
                                                     d ** -0.5)
            for key_t, fused in ((True, False), (False, False), (None, True)):
                out = torch.full_like(q, float("nan"))
                decode.decode_attention(q, cache, layer.key_rotation, layer.value_rotation, mean, d ** -0.5, out=out,
                                        key_t=key_t, fused=fused)
                err = ((out.float() - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
                worst = max(worst, err if err == err else float("inf"))
                print(f"decode heads {heads}/{kv_heads} d {d} G {g} lengths {lengths[:4]} mean {mean is not None} "
                      f"key_t {key_t} fused {fused}: max rel err {err:.2e}", flush=True)
    return worst


def check_write(gen) -> int:
    bsz, heads, d, s, w, g = 3, 8, 128, 64, 256, 64
    layer = layer_of(gen, heads, d)
    kr = write.prepare_rotation(layer.key_rotation, layer.key_mean)
    vr = write.prepare_rotation(layer.value_rotation, layer.value_mean)
    ref, got = (kvstore.empty_cache(bsz, heads, d, 1024, g, 64, s, w, device="cuda", key_axis="channel")
                for _ in range(2))
    for n, starts in [(200, torch.tensor([0, 7, 150], dtype=torch.int32, device="cuda"))] + [(1, None)] * 300:
        k = (torch.randn(bsz, heads, n, d, generator=gen).cuda() * 2).bfloat16()
        v = torch.randn(bsz, heads, n, d, generator=gen).cuda().bfloat16()
        for c in (ref, got):
            kvstore.advance(c, n, starts)
        kvstore.append(ref, k, v, layer, starts)
        write.leave_blocks(got, layer.key_clip, layer.value_clip, n, starts)
        write.append_kv(got, k, v, kr, vr, layer.key_clip, layer.value_clip, starts, evict=False)
    worst = 0
    for name in ("key_codes", "key_scale", "key_zero", "value_codes", "value_scale", "value_zero"):
        a, b = getattr(got, name), getattr(ref, name)
        if "codes" in name:
            a, b = quant.unpack_int2(a), quant.unpack_int2(b)
        diff = (a.int() - b.int()).abs()
        worst = max(worst, int(diff.max()))
        print(f"write {name}: equal {(diff == 0).float().mean().item():.4f}, max diff {int(diff.max())}")
    print(f"write lengths {got.lengths.tolist()}, INT2 tokens {got.int2_tokens().tolist()}")
    return worst


def random_store(batch, context, key_axis, gen):
    """A full store of random codes (timing only)."""
    cache = kvstore.empty_cache(batch, 8, 128, context, 64, 64, device="cuda", key_axis=key_axis)
    for name in ("key_codes", "value_codes", "key_zero", "value_zero"):
        t = getattr(cache, name)
        t.copy_(torch.randint(-20 if "zero" in name else 0, 20 if "zero" in name else 256, t.shape, device="cuda",
                              generator=gen).to(t.dtype))
    for name in ("key_scale", "value_scale"):
        getattr(cache, name).fill_(120)
    for name in ("key_sink", "value_sink", "key_recent", "value_recent"):
        getattr(cache, name).normal_(generator=gen)
    cache.lengths.fill_(context)
    return cache


def timing(gen) -> None:
    rot = torch.linalg.qr(torch.randn(8, 128, 128, device="cuda", dtype=torch.float64))[0].float().contiguous()
    for batch, context in ((1, 32768), (8, 32768), (32, 32768), (1, 100_000)):
        q = torch.randn(batch, 32, 128, device="cuda", generator=gen).bfloat16()
        row = []
        for axis, gluon in (("token", None), ("token", False), ("channel", False)):
            cache = random_store(batch, context, axis, gen)
            ms = do_bench(lambda: decode.decode_attention(q, cache, rot, rot, None, 0.088, gluon=gluon),
                          warmup=25, rep=200, return_mode="median")
            row.append(f"{axis}{'' if gluon is None else ' triton'} {ms:.3f} ms")
        print(f"batch {batch} context {context}: " + ", ".join(row), flush=True)


def main() -> int:
    gen = torch.Generator().manual_seed(0)
    worst = check_decode(gen)
    codes = check_write(gen)
    timing(torch.Generator(device="cuda").manual_seed(0))
    print(f"worst decode error {worst:.2e}, worst code difference {codes}")
    return 0 if worst < 1e-2 and codes <= 1 else 1


if __name__ == "__main__":
    sys.exit(main())
