"""The paged INT2 store (paged.py) against kvstore's reference, the decode programs through block tables (on the CPU
through Triton's interpreter, as tests/test_triton_kernels.py loads them), and the bundle-to-backend mapping
(backend.py)."""

import dataclasses
import importlib
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from oscar_core import kvstore, paged  # noqa: E402
from oscar_core.serve import backend  # noqa: E402
from oscar_core.formats.bundle import Bundle, LayerQuant  # noqa: E402
from oscar_core.errors import OscarError  # noqa: E402
from oscar_core.triton import plan as rules  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from tiny_bundle import tiny_manifest  # noqa: E402

PAGE = paged.PAGE_TOKENS


def orthogonal(heads, d, gen):
    return torch.linalg.qr(torch.randn(heads, d, d, generator=gen, dtype=torch.float64))[0].float()


def layer_of(gen, kv_heads, d):
    return kvstore.LayerRotation(orthogonal(kv_heads, d, gen), orthogonal(kv_heads, d, gen),
                                 torch.full((kv_heads,), 0.96), torch.full((kv_heads,), 0.92),
                                 torch.randn(kv_heads, d, generator=gen), torch.randn(kv_heads, d, generator=gen))


def data(gen, layer, batch, tokens):
    """keys/values [B, tokens, H_kv, d] with the per-channel offsets the layer's means capture."""
    kv_heads, d = layer.key_mean.shape
    keys = (torch.randn(batch, tokens, kv_heads, d, generator=gen) + layer.key_mean).bfloat16()
    values = (torch.randn(batch, tokens, kv_heads, d, generator=gen) + layer.value_mean).bfloat16()
    return keys, values


class Pages:
    """A shuffled free list of pages, handed to sequences as they grow (as vLLM's block pool does)."""

    def __init__(self, store: paged.PagedKVCache, gen):
        self.store, self.free = store, torch.randperm(len(store.pool), generator=gen).tolist()
        self.held = [0] * len(store.lengths)

    def grow(self):
        for b, n in enumerate(self.store.lengths.tolist()):
            while self.held[b] * PAGE < n:
                self.store.block_table[b, self.held[b]] = self.free.pop()
                self.held[b] += 1


def pair(gen, lengths, kv_heads=2, d=64, key_axis="token", value_layout="tiles", capacity=None, num_pages=None):
    """The same prefill in a kvstore store and in a paged one (shuffled pages, shuffled window slots)."""
    layer = layer_of(gen, kv_heads, d)
    capacity = capacity or max(lengths) + 8
    keys, values = data(gen, layer, len(lengths), max(lengths))
    ref = kvstore.empty_cache(len(lengths), kv_heads, d, capacity, key_axis=key_axis, value_layout=value_layout)
    kvstore.prefill(ref, keys, values, torch.tensor(lengths), layer)
    max_pages = -(-capacity // PAGE)
    store = paged.empty_paged(num_pages or len(lengths) * max_pages + 3, len(lengths), max_pages, kv_heads, d,
                              key_axis=key_axis, value_layout=value_layout, window_slots=len(lengths) + 2)
    store.window_slot.copy_(torch.randperm(len(lengths) + 2, generator=gen)[:len(lengths)])
    pages = Pages(store, gen)
    store.lengths.copy_(torch.tensor(lengths))
    pages.grow()
    paged.prefill(store, keys, values, torch.tensor(lengths), layer)
    return ref, store, pages, layer


def same_tokens(ref, store):
    for b in range(len(ref.lengths)):
        for want, got in zip(kvstore.sequence_kv(ref, b), paged.sequence_kv(store, b)):
            assert torch.equal(want, got), b


def test_page_layout_is_views_of_one_pool():
    assert paged.page_bytes(2, 128) == 2 * (2 * 64 * 32) + 4 * (2 * 64 * 2)
    assert paged.page_bytes(2, 128, key_axis="channel") == paged.page_bytes(2, 128)   # one block of 128 codes
    store = paged.empty_paged(5, 2, 4, 2, 128, key_axis="channel")
    layout = paged.page_layout(2, 128, key_axis="channel")
    assert store.key_scale.shape == (5, 2, 1, 128) and store.value_scale.shape == (5, 2, PAGE, 2)
    for name, (offset, shape, dtype) in layout.items():
        array = getattr(store, name)
        assert array.untyped_storage().data_ptr() == store.pool.untyped_storage().data_ptr()
        assert array.stride(0) == store.page_stride == store.pool.shape[1] and array.dtype == dtype
        array[3].view(torch.uint8).view(-1)[-1] = 7             # the last byte of page 3's array
        assert store.pool[3, offset + array[3].numel() - 1] == 7
        store.pool.zero_()


def test_int2_codes_sit_at_vllm_slots():
    """INT2 position p of sequence b is row slot mod P of page slot div P, slot = vLLM's slot mapping."""
    gen = torch.Generator().manual_seed(1)
    ref, store, _, _ = pair(gen, [700, 330], value_layout="rows")
    s = ref.sink_tokens
    for b in range(2):
        pos = torch.arange(s, s + int(ref.int2_tokens()[b]))
        slots = paged.slot_mapping(store.block_table, b, pos)
        assert torch.equal(slots, store.block_table[b, pos // PAGE].long() * PAGE + pos % PAGE)
        page, row = slots // PAGE, slots % PAGE
        for name in ("key_codes", "key_scale", "key_zero", "value_codes", "value_scale", "value_zero"):
            got = getattr(store, name)[page, :, row]                    # [n, H_kv, ...]
            assert torch.equal(got, getattr(ref, name)[b, :, pos - s].transpose(0, 1)), name


@pytest.mark.parametrize("key_axis,value_layout", [("token", "tiles"), ("token", "rows"), ("channel", "tiles")])
def test_paged_writes_equal_kvstore(key_axis, value_layout):
    """Prefill, a chunk of 70 tokens and decode steps, with pages handed out shuffled as sequences grow: every
    sequence reads back (through its block table) kvstore's tokens, bit for bit, and its pages hold kvstore's rows."""
    gen = torch.Generator().manual_seed(2)
    ref, store, pages, layer = pair(gen, [300, 64, 1, 420], key_axis=key_axis, value_layout=value_layout,
                                    capacity=700)
    same_tokens(ref, store)
    for n in (70, 1, 1, 1):
        keys, values = data(gen, layer, 4, n)
        starts = torch.tensor([0, 3, 0, n - 1]) if n > 1 else None     # leading pads, as kvstore.append takes them
        for s in (ref, store):
            kvstore.advance(s, n, starts)
        pages.grow()
        kvstore.append(ref, keys.transpose(1, 2), values.transpose(1, 2), layer, starts)
        paged.append(store, keys.transpose(1, 2), values.transpose(1, 2), layer, starts)
        same_tokens(ref, store)
    assert torch.equal(ref.lengths, store.lengths)
    for b in range(4):
        view = paged.sequence_store(store, b)
        rows = view.key_codes.shape[2]
        assert torch.equal(view.key_codes[0], ref.key_codes[b, :, :rows])
        assert torch.equal(view.value_codes[0], ref.value_codes[b, :, :rows])      # value tiles too


def test_page_problems_are_one_line():
    assert "key blocks of 128 tokens do not divide a page of 64" in paged.page_problem(64, 64, 128, "channel")
    assert "sink of 32 tokens" in paged.page_problem(64, 32, 64, "token")
    assert "64-row tiles" in paged.page_problem(32, 0, 64, "token")
    assert "not paged yet" in paged.page_problem(64, 64, 64, "token", window=4096)
    assert paged.page_problem(128, 128, 128, "channel") is None
    with pytest.raises(ValueError, match="do not divide"):
        paged.empty_paged(4, 1, 4, 2, 64, key_group_size=128, key_axis="channel")
    store = paged.empty_paged(4, 1, 2, 2, 64)
    store.lengths[0] = 3 * PAGE
    with pytest.raises(ValueError, match="needs 3 pages"):
        paged.sequence_store(store, 0)


def test_plan_keeps_paged_stores_off_the_gluon_programs():
    hopper = rules.Device(cuda=True, sms=132, major=9, gluon=True, slots=lambda c, o: 16)
    shape = rules.DecodeShape(batch=32, heads=16, kv_heads=2, head_dim=128, key_group=64, value_group=64,
                              rows=100_032)
    assert rules.choose_plan(shape, hopper).gluon
    shape = dataclasses.replace(shape, page=PAGE, joint=False)
    assert "block table" in rules.gluon_problem(shape, hopper)
    plan = rules.choose_plan(shape, hopper)
    assert not plan.gluon and plan.tma == 0
    with pytest.raises(ValueError, match="block table"):
        rules.choose_plan(shape, hopper, gluon=True)
    with pytest.raises(ValueError, match="block table"):
        rules.check_plan(shape, dataclasses.replace(plan, gluon=True), hopper)


# The decode programs, through the interpreter (reloaded with it if another test module imported them first).
triton = pytest.importorskip("triton")
from oscar_core.triton import decode, decode_programs, paged_write, write  # noqa: E402

if not torch.cuda.is_available() and not isinstance(decode_programs._split_kernel,
                                                    triton.runtime.interpreter.InterpretedFunction):
    importlib.reload(sys.modules["oscar_core.triton.write"])
    decode_programs = importlib.reload(sys.modules["oscar_core.triton.decode_programs"])
    decode = importlib.reload(sys.modules["oscar_core.triton.decode"])

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def to_device(store):
    if isinstance(store, kvstore.Int2KVCache):
        return kvstore.to_device(store, DEVICE)
    fields = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in vars(store).items()}
    pool = fields["pool"]
    layout = paged.page_layout(store.key_codes.shape[1], store.key_codes.shape[3] * 4, store.key_group_size,
                               store.value_group_size, store.key_axis, store.page_tokens)
    return paged.PagedKVCache(**dict(fields, graphs={}, **paged.pool_views(pool, layout)))


@pytest.mark.parametrize("key_axis,value_layout,key_t,block_n", [
    ("token", "tiles", True, 32),
    ("token", "rows", False, 128),      # tiles longer than a page: each row's page looked up
    ("channel", "tiles", True, 64),
    ("channel", "rows", False, 32),
])
def test_paged_decode_equals_unpaged(key_axis, value_layout, key_t, block_n):
    """The decode programs over pages (shuffled pages and window slots, sequences of different lengths, block table
    entries past a sequence's pages pointing nowhere) give the unpaged call's outputs bit for bit, within 1% of
    kvstore's reference."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, d = 8, 2, 64
    lengths = [900, 50, 330, 65, 449]
    ref, store, pages, layer = pair(gen, lengths, kv_heads, d, key_axis, value_layout, capacity=1000)
    for b, held in enumerate(pages.held):
        store.block_table[b, held:] = 1 << 20       # never read: past the sequence's pages
    q = torch.randn(len(lengths), heads, d, generator=gen)
    scaling = d ** -0.5
    args = [t.to(DEVICE) for t in (layer.key_rotation, layer.value_rotation, layer.value_mean)] + [scaling]
    outs = []
    for s in (ref, store):
        s = to_device(s)
        plan = dataclasses.replace(decode.plan_for(q.to(DEVICE), s), block_n=block_n, key_t=key_t)
        assert not plan.gluon
        outs.append(decode.decode_attention(q.to(DEVICE), s, *args, plan).cpu())
    assert torch.equal(outs[0], outs[1])
    want = kvstore.decode_attention_reference(q, ref, layer.key_rotation, layer.value_rotation, layer.value_mean,
                                              scaling)
    err = (outs[1] - want).norm(dim=-1) / want.norm(dim=-1)
    assert err.max() < 1e-2, err



# The Triton writes into pages (triton/paged_write.py), through the interpreter as the decode programs above (a reload
# keeps the module object, which paged_write reads its launchers from).
if not torch.cuda.is_available() and not isinstance(write._append_kernel,
                                                    triton.runtime.interpreter.InterpretedFunction):
    importlib.reload(write)

INT2 = ("key_codes", "key_scale", "key_zero", "value_codes", "value_scale", "value_zero")
WINDOWS = ("key_sink", "value_sink", "key_recent", "value_recent")


def written(key_axis, value_layout, lengths, steps, chunk=37, sink=64, recent=64, kv_heads=2, d=64, seed=5):
    """The same prefill (left-padded), a chunk of `chunk` tokens (left pads) and `steps` decode steps written four
    ways: Triton into pages (paged_write), the torch paged reference (paged.prefill / paged.append: the same block
    tables and window slots), the Triton kernels into an unpaged kvstore store, and kvstore's reference; pages
    handed out shuffled as the sequences grow."""
    gen = torch.Generator().manual_seed(seed)
    layer = layer_of(gen, kv_heads, d)
    bsz, n = len(lengths), max(lengths)
    capacity = n + chunk + steps
    max_pages = -(-capacity // PAGE)
    kw = dict(key_axis=key_axis, value_layout=value_layout)
    got = paged.empty_paged(bsz * max_pages + 5, bsz, max_pages, kv_heads, d, sink_tokens=sink, recent_tokens=recent,
                            window_slots=bsz + 2, device=DEVICE, **kw)
    got.window_slot.copy_(torch.randperm(bsz + 2, generator=gen)[:bsz])
    ref = paged.empty_paged(len(got.pool), bsz, max_pages, kv_heads, d, sink_tokens=sink, recent_tokens=recent,
                            window_slots=bsz + 2, **kw)
    ref.window_slot.copy_(got.window_slot.cpu())
    flat = kvstore.empty_cache(bsz, kv_heads, d, capacity, sink_tokens=sink, recent_tokens=recent, device=DEVICE,
                               rows=max_pages * PAGE - sink, **kw)
    truth = kvstore.empty_cache(bsz, kv_heads, d, capacity, sink_tokens=sink, recent_tokens=recent, **kw)
    pages = Pages(got, gen)
    on = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in vars(layer).items()}
    split = (write.prepare_rotation(on["key_rotation"], on["key_mean"]),
             write.prepare_rotation(on["value_rotation"], on["value_mean"]))
    clips = on["key_clip"].float(), on["value_clip"].float()

    def step(n, starts, first):
        keys, values = (x.transpose(1, 2) for x in data(gen, layer, bsz, n))          # [B, H_kv, n, d]
        for s in (got, ref, flat, truth):
            kvstore.advance(s, n, None if starts is None else starts.to(s.lengths.device))
        pages.grow()
        ref.block_table.copy_(got.block_table.cpu())
        dev = (keys.to(DEVICE), values.to(DEVICE), *split, *clips)
        st = None if starts is None else starts.to(DEVICE, torch.int32)
        if first:
            paged_write.prefill(got, *dev)
            write.prefill_kv(flat, *dev)
        else:
            paged_write.append(got, *dev, st)
            if key_axis == "channel":
                write.leave_blocks(flat, *clips, n, st)
            write.append_kv(flat, *dev, st, evict=key_axis == "token")
        paged.append(ref, keys, values, layer, starts)
        kvstore.append(truth, keys, values, layer, starts)

    step(n, torch.tensor([n - length for length in lengths], dtype=torch.int32), True)
    step(chunk, torch.tensor([0, 3, 0, chunk - 1][:bsz], dtype=torch.int32), False)
    for _ in range(steps):
        step(1, None, False)
    return SimpleNamespace(got=got, ref=ref, flat=flat, truth=truth, layer=layer, pages=pages)


def cpu(store):
    fields = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in vars(store).items()}
    return paged.PagedKVCache(**dict(fields, graphs={}, **paged.pool_views(fields["pool"], paged.page_layout(
        store.key_codes.shape[1], store.key_codes.shape[3] * 4, store.key_group_size, store.value_group_size,
        store.key_axis, store.page_tokens))))


# Sink 64, window 64 (keys per channel: a ring of 128), pages and key blocks of 64, a chunk of 37 tokens (pads 0, 3,
# 0, 36), then 5 decode steps: lengths 190, 1, 344, 126 -> 227, 35, 381, 127 -> 232, 40, 386, 132. The chunk moves
# sequence 0's first key block (positions 64-127) into its page; in the steps sequence 2 evicts positions 317-321
# (keys per token: across pages 4 and 5) and its block 256-319 leaves at length 384 (keys per channel), sequence 3
# evicts its first INT2 tokens (64, 65, ...), sequence 1 stays in its sink.
LENGTHS, STEPS = [190, 1, 344, 126], 5


@pytest.mark.parametrize("key_axis,value_layout", [("token", "tiles"), ("token", "rows"), ("channel", "tiles"),
                                                   ("channel", "rows")])
def test_triton_paged_writes_equal_the_paged_reference(key_axis, value_layout):
    """paged_write's prefill, chunk and decode steps into shuffled pages and window slots: every sequence's pages and
    window slot hold, bit for bit, what the unpaged Triton kernels write into a kvstore store (the same arithmetic),
    and what the torch paged reference (paged.append) writes at the same rows, within the kernels' known rounding
    (a bf16 step in the windows, codes at most one step apart: tests/test_cache_kernel.py); the pages no sequence
    holds stay untouched."""
    w = written(key_axis, value_layout, LENGTHS, STEPS)
    assert w.got.lengths.tolist() == w.ref.lengths.tolist() == [232, 40, 386, 132]
    assert_pages_hold(w)


def test_a_chunk_longer_than_the_window_into_pages():
    """Keys per token, a chunk of 150 tokens after a prefill (W = 64): append_kv's launches of W tokens, tokens that
    land in INT2 directly, each row's page looked up."""
    w = written("token", "tiles", [130, 200], steps=2, chunk=150)
    assert w.got.lengths.tolist() == [282, 349]
    assert_pages_hold(w)


def assert_pages_hold(w):
    """written()'s paged_write store against the unpaged Triton store (bit for bit) and the torch paged reference
    (within the writes' rounding); pages that no sequence holds all zero."""
    from test_cache_kernel import assert_store_matches

    got, ref = cpu(w.got), w.ref
    moved = 0
    for b in range(len(got.lengths)):
        view, flat = paged.sequence_store(got, b), w.flat
        for name in INT2:
            mine = getattr(view, name)
            assert torch.equal(mine, getattr(flat, name)[b:b + 1, :, :mine.shape[2]].cpu()), (b, name)
        for name in WINDOWS:
            assert torch.equal(getattr(view, name), getattr(flat, name)[b:b + 1].cpu()), (b, name)
        assert_store_matches(view, paged.sequence_store(ref, b))
        moved += int(view.int2_tokens()[0])
    assert moved > 0
    held = {page for b, h in enumerate(w.pages.held) for page in got.block_table[b, :h].tolist()}
    free = sorted(set(range(len(got.pool))) - held)
    assert free and not got.pool[free].any()




@pytest.mark.parametrize("key_axis,value_layout,key_t,block_n", [("token", "tiles", True, 32),
                                                                 ("channel", "rows", False, 64)])
def test_decode_over_triton_written_pages(key_axis, value_layout, key_t, block_n):
    """The decode programs over the pages paged_write wrote give, bit for bit, their output over the unpaged Triton
    store of the same writes, within 1% of kvstore's reference attention over that store's tokens (as over the torch
    reference's pages); the two outputs differ by what the Triton and torch writes' rounding moves (codes one step
    apart in about 1% of entries: up to 1.3% of a head's output here, 0.35% on average)."""
    w = written(key_axis, value_layout, LENGTHS, STEPS)
    gen = torch.Generator().manual_seed(6)
    heads, d = 8, w.got.key_recent.shape[-1]
    q = torch.randn(len(LENGTHS), heads, d, generator=gen)
    layer, scaling = w.layer, d ** -0.5
    args = [t.to(DEVICE) for t in (layer.key_rotation, layer.value_rotation, layer.value_mean)] + [scaling]
    outs = []
    for s in (w.got, w.flat, w.ref):
        s = to_device(s)
        plan = dataclasses.replace(decode.plan_for(q.to(DEVICE), s), block_n=block_n, key_t=key_t)
        outs.append(decode.decode_attention(q.to(DEVICE), s, *args, plan).cpu())
    assert torch.equal(outs[0], outs[1])
    for out, store in ((outs[0], kvstore.to_device(w.flat, "cpu")), (outs[2], w.truth)):
        want = kvstore.decode_attention_reference(q, store, layer.key_rotation, layer.value_rotation,
                                                  layer.value_mean, scaling)
        err = (out - want).norm(dim=-1) / want.norm(dim=-1)
        assert err.max() < 1e-2, err                                  # 0.1% measured
    err = (outs[0] - outs[2]).norm(dim=-1) / outs[2].norm(dim=-1)
    assert err.max() < 3e-2 and err.mean() < 1e-2, err                 # 1.2-1.3%, 0.35% measured



COMPILE_PAGED = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from oscar_core.triton import write

types = dict(kcodes_ptr="*u8", vcodes_ptr="*u8", kscale_ptr="*u8", vscale_ptr="*u8", kzero_ptr="*i8", vzero_ptr="*i8",
             kclip_ptr="*fp32", vclip_ptr="*fp32", kmr_ptr="*fp32", vmr_ptr="*fp32", len_ptr="*i32", start_ptr="*i32",
             bt_ptr="*i32", ws_ptr="*i32")
for name, const in json.loads(sys.argv[1]):
    fn = getattr(write, name)
    sig = {a: types.get(a, "*bf16" if a.endswith("_ptr") else "i32") for a in fn.arg_names if a not in const}
    src = ASTSource(fn=fn, signature=dict(sig, **{k: "constexpr" for k in const}), constexprs=const)
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=1))
"""


def test_paged_write_programs_compile_for_sm90():
    """The interpreter runs what the compiler would refuse (a variable of two shapes in the branches of a runtime if):
    the PAGED write programs compile for an H100 (sm_90) with triton's own compiler, in a process of its own without
    TRITON_INTERPRET (test_float32_products.py): the prefill (keys per channel, values in tiles) and the append
    (evicting and direct rows, leading pads) at head_dim 64, leave_blocks at 128 (key blocks of 64 tokens)."""
    import json
    import subprocess

    if not (Path(triton.__file__).parent / "backends/nvidia/bin/ptxas").exists():
        pytest.skip("this triton has no CUDA backend")
    common = dict(H=2, D=64, C=64, F32=False, VT=True, RING=False, PAGED=True, PAGE=64, S=64, W=64)
    kernels = [("_prefill_kernel", dict(common, GK=64, GV=64, R=128, TB=64, BT=64, K_MEAN=True, V_MEAN=True,
                                        AHEAD=True)),
               ("_append_kernel", dict(common, GK=64, GV=64, R=64, BT=16, K_MEAN=True, V_MEAN=True, HAS_START=True,
                                       EVICT=True, DIRECT=True)),
               ("_leave_kernel", {k: v for k, v in dict(common, D=128, G=64, GV=64, R=128, HAS_START=True).items()
                                  if k != "C"})]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", COMPILE_PAGED, json.dumps(kernels)], env=env, capture_output=True,
                         text=True, cwd=Path(__file__).parent.parent)
    assert run.returncode == 0, run.stderr[-3000:]


# The bundle-to-backend mapping.

def bundle_of(layers=3, heads=8, kv_heads=2, d=64, key_group=64, value_group=64, axes=None, int2_layers=None,
              windows=None, sink=64):
    gen = torch.Generator().manual_seed(4)
    m = tiny_manifest()
    m = m.model_copy(update=dict(
        model=m.model.model_copy(update=dict(num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=d)),
        quant=m.quant.model_copy(update=dict(key_group_size=key_group, value_group_size=value_group, sink_tokens=sink,
                                             layers=[LayerQuant(layer=i, key_axis=a) for i, a in (axes or {}).items()])),
        rotation=m.rotation.model_copy(update=dict(key_centering=True, layers=int2_layers, windows=windows))))
    tensors = {}
    for i in (range(layers) if int2_layers is None else int2_layers):
        tensors |= {f"layers.{i}.key_rotation": orthogonal(kv_heads, d, gen),
                    f"layers.{i}.value_rotation": orthogonal(kv_heads, d, gen),
                    f"layers.{i}.key_clip": torch.rand(kv_heads, generator=gen),
                    f"layers.{i}.value_clip": torch.rand(kv_heads, generator=gen),
                    f"layers.{i}.key_mean": torch.randn(kv_heads, d, generator=gen),
                    f"layers.{i}.value_mean": torch.randn(kv_heads, d, generator=gen)}
    return Bundle(path=Path("."), manifest=m, tensors=tensors)


def config_of(layers=3, heads=8, kv_heads=2, d=64, layer_types=None, sliding_window=None,
              architecture="LlamaForCausalLM"):
    return SimpleNamespace(num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                           head_dim=d, hidden_size=heads * d, architectures=[architecture], layer_types=layer_types,
                           sliding_window=sliding_window, max_position_embeddings=2048)


def test_served_layers_carry_the_bundle_per_layer():
    bundle = bundle_of(axes={1: "channel"})
    served = backend.served_layers(bundle, config_of())
    assert [s.kind for s in served] == ["int2"] * 3
    assert [s.key_axis for s in served] == ["token", "channel", "token"]
    s = served[1]
    assert (s.key_group, s.value_group, s.sink_tokens, s.recent_tokens, s.page_tokens) == (64, 64, 64, 256, 64)
    for name in ("key_rotation", "value_rotation", "key_clip", "value_clip", "key_mean", "value_mean"):
        assert torch.equal(getattr(s.rotation, name), bundle.layer(1, name)), name


def test_served_layers_of_a_model_with_short_sliding_windows():
    """Sliding layers of 512 tokens (kept whole in BF16 by the bundle) are the server's BF16 layers."""
    types = ["sliding_attention", "full_attention", "sliding_attention"]
    bundle = bundle_of(int2_layers=[1], windows={"0": 512, "2": 512})
    served = backend.served_layers(bundle, config_of(layer_types=types, sliding_window=512))
    assert [(s.kind, s.window) for s in served] == [("bf16", 512), ("int2", None), ("bf16", 512)]


@pytest.mark.parametrize("bundle,config,message", [
    (bundle_of(), config_of(kv_heads=4), "is for oscar-test/tiny-llama (num_kv_heads 2), the served model has "
                                         "num_kv_heads 4"),
    (bundle_of(), config_of(layers=4), "num_layers 3"),
    (bundle_of(), config_of(architecture="Qwen2ForCausalLM"), "the served model is a Qwen2ForCausalLM"),
    (bundle_of(int2_layers=[1], windows={"0": 512, "2": 512}),
     config_of(layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=1024),
     "layer 0: the served model attends to a window of 1024"),
    (bundle_of(key_group=128, value_group=64, d=128, axes={2: "channel"}), config_of(d=128),
     "layer 2 of bundle oscar-test/tiny-llama cannot be served in pages: key blocks of 128 tokens do not divide a "
     "page of 64 tokens"),
    (bundle_of(d=32, key_group=32, value_group=32), config_of(d=32), "layer 0 of bundle oscar-test/tiny-llama cannot "
                                                                      "be served in pages: decode_attention supports "
                                                                      "head_dim 64"),
    (bundle_of(sink=32), config_of(), "a sink of 32 tokens is not a whole number of 64-token pages"),
    (bundle_of(windows={"1": 4096}), config_of(layer_types=["full_attention", "sliding_attention", "full_attention"],
                                               sliding_window=4096),
     "layer 1 of bundle oscar-test/tiny-llama cannot be served in pages: a sliding window of 4096 tokens"),
])
def test_bad_input_is_one_line(bundle, config, message):
    with pytest.raises(OscarError, match="^[^\n]*$") as e:
        backend.served_layers(bundle, config)
    assert message in str(e.value)
