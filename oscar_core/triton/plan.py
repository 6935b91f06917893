"""How a decode call launches: its DecodePlan, and the rules that choose it from the call's shape and the device.

decode.decode_attention reads a call as a DecodeShape (the query's and the store's shapes) on a Device (its
multiprocessors, compute capability, whether this triton has Gluon, how many Gluon programs a multiprocessor holds).
choose_plan applies the rules of docs/kernels.md's table to them in order and returns a DecodePlan, every launch
setting the programs take. The rules are pure functions of those facts (no torch, no device query), so a test gives
them shapes and a count of multiprocessors and checks the plan.

A caller changes a plan with dataclasses.replace (a bench variant: other tiles, warps or waves), or pins one of the
choices other rules follow (gluon, heads_per_program, flat, pdl) in choose_plan and lets the rest follow it;
check_plan refuses, before any launch, a plan the device or the store cannot run.

The shapes no program serves are decided here too: shape_problem (for every program, and for OscarCache through
cache.kernel_problem) and gluon_problem (for the Gluon INT2 programs, which the Triton ones stand in for).
"""

import dataclasses
from typing import Callable

# Gluon INT2 splits a (sequence, KV head) at most: past it, at 1-3 pairs, the partials the reduce merges cost more
# than the programs' share of a wave gains (H200, Qwen2.5-0.5B 100K x 1: 35.4 µs at 785 splits, 26.9 at 396, 24.3
# at 201; bench/results/max_gluon_splits.txt). Below it the wave's splits stay (Qwen3-8B's 228 at 100K x 1).
MAX_GLUON_SPLITS = 256
GLUON_TILE = 64         # rows of a Gluon program's tile (and of a TMA ring's stage)


def pow2(n: int) -> int:
    """The smallest power of two ≥ n (1 for n ≤ 1)."""
    return 1 << max(n - 1, 0).bit_length()


@dataclasses.dataclass(frozen=True)
class DecodeShape:
    """What the rules read of a call: the query's shape and its store's layout (kvstore.Int2KVCache)."""
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    key_group: int              # channels a key group; keys per channel: tokens a key block
    value_group: int
    key_axis: str = "token"
    sink: int = 64
    recent: int = 256
    ring_slots: int = 256       # BF16 ring slots: recent, and a key block more with keys per channel
    rows: int = 0               # INT2 rows a (sequence, KV head) holds (T)
    value_tiles: bool = True    # value codes in 64-row tiles (value_layout "tiles")
    window: bool = False        # a sliding layer's store (kvstore.window_cache): its INT2 rows a ring
    joint: bool = True          # INT2 arrays laid out as kvstore.empty_cache lays them (decode.tma_descriptors)
    page: int = 0               # a paged store's tokens a page (paged.PagedKVCache; rows: its most); 0: not paged

    @property
    def pairs(self) -> int:
        """(sequence, KV head) pairs."""
        return self.batch * self.kv_heads

    @property
    def heads_per_kv(self) -> int:
        return self.heads // self.kv_heads

    @property
    def token_block(self) -> int:
        """Tokens that leave the BF16 ring together: 1, or a key block with keys per channel."""
        return self.key_group if self.key_axis == "channel" else 1

    @property
    def hole(self) -> bool:
        """Whether the programs skip expired rows: a window's store with keys per channel, whose rows hold up to
        G − 1 tokens of its oldest block that have left the window (decode_programs.expired_rows)."""
        return self.window and self.token_block > 1

    def max_int2(self, max_length: int | None = None) -> int:
        """INT2 rows a sequence of max_length tokens holds (None: the store's capacity)."""
        if max_length is None:
            max_length = self.rows + self.sink + self.recent
        return min(max(max_length - self.sink - self.recent, 0), self.rows)


@dataclasses.dataclass(frozen=True)
class Device:
    """What the rules read of the device (decode.device_of builds it; the defaults: no GPU, the interpreter)."""
    cuda: bool = False
    sms: int = 4                # multiprocessors (the grid's wave)
    major: int = 0              # compute capability, major version
    gluon: bool = False         # this triton has Gluon
    # One-warp Gluon programs a multiprocessor holds, for their constexprs and compile options (decode compiles
    # the program to count its registers and shared memory: resident_warps).
    slots: Callable[[dict, dict], int] | None = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """Every launch setting of a decode call; each field is one rule's choice (docs/kernels.md, the plan's table)."""
    gluon: bool                 # the INT2 rows by the Gluon programs (else by the Triton split programs)
    pdl: bool                   # programmatic dependent launch after the query rotation
    block_n: int                # Triton INT2 tile rows (capped at the key block with keys per channel)
    num_warps: int              # Triton split programs' warps (windows and INT2 rows)
    num_stages: int             # Triton split programs' pipeline stages
    waves: int                  # INT2 splits a multiprocessor (Gluon: splits of heads_per_program heads)
    min_chunk: int              # INT2 rows a split at least
    key_t: bool                 # Triton INT2 score tiles transposed (tokens as rows)
    window_warps: int           # the window programs' warps beside the Gluon programs
    block_c: int                # reduce: columns of õ a program merges and rotates
    reduce_heads: int           # reduce: query heads a program
    rotate_heads: int           # query rotation: query heads a program
    block_w: int = 64           # window tokens a window program
    use_asm: bool = True        # the PTX unpack (off in the CPU interpreter)
    # The Gluon INT2 programs (read only with gluon):
    gluon_heads: int = 4        # query heads a program (R4)
    mask_all: bool = False      # every tile's scores masked (else only a program's last tile)
    keys_ahead: bool = False    # a tile's key words loaded during the tile before
    prefetch: int = 0           # tiles ahead hinted into L2 (0: none)
    strided: bool = False       # split i takes tiles i, i + A, ... of the A splits with rows
    flat: bool = False          # every program an equal share of a line of all pairs' rows
    tma: int = 0                # stages of the TMA ring the tiles come through (0: loads into registers)
    maxnreg: int | None = None  # registers a thread at most (None: the compiler's choice)


def shape_problem(heads: int, kv_heads: int, head_dim: int, key_group: int, value_group: int,
                  key_axis: str = "token") -> str | None:
    """Why no decode program serves attention of this shape (None: the Triton programs do); key_axis "channel":
    keys per channel over blocks of key_group tokens."""
    if head_dim not in (64, 128, 256):
        return f"decode_attention supports head_dim 64, 128 or 256, not {head_dim}"
    if key_axis == "channel" and key_group not in (64, 128, 256):
        return f"decode_attention needs key blocks of 64, 128 or 256 tokens for keys per channel, not {key_group}"
    groups = (("value", value_group),) if key_axis == "channel" else (("key", key_group), ("value", value_group))
    for name, g in groups:
        if g not in (64, 128, 256) or g > head_dim:
            return (f"decode_attention needs a {name} group size of 64, 128 or 256 channels within head_dim "
                    f"{head_dim}, not {g}")
    if kv_heads < 1 or heads % kv_heads:
        return f"{heads} query heads are not a multiple of {kv_heads} KV heads"
    if heads // kv_heads > 16:
        return f"decode_attention supports up to 16 query heads per KV head, not {heads // kv_heads}"
    return None


def gluon_problem(shape: DecodeShape, device: Device) -> str | None:
    """Why the Gluon INT2 programs (decode_gluon.py) do not serve a call the Triton programs serve (None: they do):
    they need a CUDA device of compute capability 8.0 or newer, head_dim 64, 128 or 256, value groups (and key
    groups, keys per token; key blocks, keys per channel) of 64 or 128 within the head, up to 16 query heads per KV
    head, and whole 64-row blocks of INT2 rows (kvstore.int2_rows allocates them so); they do not read pages
    through a block table (a paged store's rows go to the Triton programs)."""
    d, gk, gv = shape.head_dim, shape.key_group, shape.value_group
    if shape.page:
        return "they do not read pages through a block table yet (paged stores run the Triton programs)"
    if not device.cuda or device.major < 8:
        return "they need a CUDA GPU of compute capability 8.0 or newer"
    if not device.gluon:
        return "this triton has no Gluon"
    if d not in (64, 128, 256):
        return f"they take head_dim 64, 128 or 256, not {d}"
    if gk not in (64, 128) or (shape.key_axis == "token" and gk > d):
        return f"they take key groups (or key blocks) of 64 or 128 within the head, not {gk}"
    if gv not in (64, 128) or gv > d:
        return f"they take value groups of 64 or 128 within the head, not {gv}"
    if shape.heads_per_kv > 16:
        return f"they take up to 16 query heads per KV head, not {shape.heads_per_kv}"
    if shape.rows % GLUON_TILE:
        return f"they read whole {GLUON_TILE}-row blocks of INT2 rows, not {shape.rows} rows"
    return None


def use_gluon(shape: DecodeShape, max_int2: int) -> bool:
    """Whether the Gluon programs take the INT2 rows where they can: for more than 16 pairs, from 4K INT2 rows, or
    above 4 query heads a KV head; below that the Triton programs' one launch fewer may pay (H100, graph, 8K x 1:
    Qwen3-8B 0.023 against 0.025 ms, keys per channel 0.024 against 0.032, GQA 16 0.033 against 0.065). At head_dim
    256 below 8 pairs the Triton programs' four-warp tiles win up to 100K with keys per token (Gemma 3 270M's 4/1
    heads at 100K x 1: 0.036 against 0.044 ms) and up to 64K with keys per channel."""
    pairs = shape.pairs
    if max_int2 <= 0 or not (pairs > 16 or max_int2 >= 4096 or shape.heads_per_kv > 4):
        return False
    if shape.head_dim == 256 and pairs < 8:
        return shape.key_axis == "channel" and max_int2 >= 65536
    return True


def programmatic_launch(device: Device) -> bool:
    """Whether a launch can start before the one it depends on ends (programmatic dependent launch,
    griddepcontrol): CUDA devices of compute capability 9.0 or newer."""
    return device.cuda and device.major >= 9


def use_pdl(pairs: int, gluon: bool, device: Device) -> bool:
    """Programmatic dependent launch at 8 pairs or fewer, where the launch gaps are a share of the call worth saving
    (H200, graph, off / on: Qwen3-8B 8K x 1 0.0204 / 0.0197 ms, 100K x 1 0.0458 / 0.0445), and beyond with the
    Gluon programs, for them and the reduce (the window programs then launched plainly: launched early they cost
    more than the gaps, 16K x 8 0.0582 / 0.0616 ms; H100, batch 8: 0.2-2.9% faster)."""
    return (pairs <= 8 or gluon) and programmatic_launch(device)


def program_config(pairs: int, head_dim: int = 128, gluon: bool = False) -> dict:
    """The split programs' settings by (sequence, KV head) pairs and head_dim (tuned on an H100 at 100K context).
    From 17 pairs up, one-warp Triton programs (two at head_dim 256, whose value accumulators would not fit one warp's
    registers): no cross-warp reductions or barriers a tile, enough of them (48 waves) to fill every multiprocessor,
    at least 512 rows each. Up to 16 pairs, four-warp programs. Each setting compiled for sm_90 fits shared memory
    without spilling in the loop. The Gluon INT2 programs take 64-token tiles, one whole wave of them (gluon_waves),
    at least 128 rows each (H100, graph, against 256: Qwen3-8B 8K x 1 0.0214 against 0.0249 ms, head_dim 256 at 1-8
    pairs 2-20% faster); there num_warps is the window programs' at 8 pairs or fewer below head_dim 256."""
    if gluon:
        return dict(block_n=GLUON_TILE, num_warps=2 if head_dim > 128 else 1, num_stages=1, waves=16, key_t=True,
                    min_chunk=128)
    if pairs > 16:
        cfg = dict(block_n=64, num_warps=1, num_stages=4 if pairs >= 128 else 3, waves=48, key_t=pairs >= 128,
                   min_chunk=512)
        if head_dim > 128:
            cfg.update(num_warps=2, num_stages=2)
        return cfg
    # block_n 128 outside head_dim 128: at 256 the staged tiles, at 64 the registers (the loop spills at 256).
    return dict(block_n=256 if head_dim == 128 else 128, num_warps=4, num_stages=2, waves=2, key_t=True,
                min_chunk=0)


def window_warps(pairs: int, head_dim: int, gluon: bool, num_warps: int) -> int:
    """The window programs' warps beside the Gluon programs: they get their slots as Gluon programs finish, and
    with 8 warps finish sooner (H100, graph, 1 / 4 / 8 warps, µs: Qwen3-8B 32K x 8 90.9 / 87.5 / 85.4, 100K x 8
    208.4 / 205.1 / 204.4); beyond 64 pairs 4 (100K x 32 760.0 / 761.8 / 766.0). At 8 pairs or fewer below head_dim
    256, where gluon_waves leaves them a slot, the Triton programs' num_warps (within noise); at head_dim 256 it
    leaves none, so 8 there too (Gemma 3 270M 16K x 8, 2 / 4 / 8 warps: 38.7 / 34.9 / 33.9 µs)."""
    if gluon and (pairs > 8 or head_dim == 256):
        return 8 if pairs <= 64 else 4
    return num_warps


def gluon_min_chunk(max_int2: int, min_chunk: int = 128) -> int:
    """INT2 rows a Gluon split at least: min_chunk, and enough for at most MAX_GLUON_SPLITS splits a pair."""
    return max(min_chunk, -(-max_int2 // MAX_GLUON_SPLITS))


def gluon_heads(heads_per_kv: int, head_dim: int, heads_per_program: int | None = None) -> int:
    """Query heads a Gluon program takes (R4; a KV head's heads go to ⌈HG / R4⌉ programs). heads_per_program None:
    8 from 5 heads a KV head, else 4. An 8-head program has a score column a head (keys per token: a score tile a
    key group), so it costs about what a 4-head one does (H100, 100K x 8, GQA 8: 0.29 against 0.43 ms keys per
    token, 0.34 against 0.50 keys per channel). 16 heads a program (two score columns of the mma, 255 registers with
    spills) is an option, not the rule: 4-14% faster with keys per token at 100K x 8 from 9 heads a KV head, 10-40%
    slower with keys per channel and at 16K. At head_dim 256 always 4 (its four value accumulators and query
    operands take 248-253 registers at 4 heads)."""
    if heads_per_program is None:
        heads_per_program = 8 if heads_per_kv > 4 else 4
    if head_dim == 256:
        heads_per_program = 4
    return max(4, pow2(min(heads_per_kv, heads_per_program)))


def mask_every_tile(head_dim: int, heads_per_program: int, value_groups: int, value_tiles: bool = False) -> bool:
    """Whether the Gluon programs mask every tile's scores to their rows (else only a program's last tile, behind a
    warp-uniform branch, 25-50 instructions a tile fewer). Only the 4-head head_dim 128 program with two value groups
    a token and value codes in rows runs faster masking every tile, ptxas scheduling its loop worse around the
    branch (H100, 100K x 8, every tile / last tile: Qwen3-8B 0.2259 / 0.2280 ms); elsewhere the branch wins or ties
    (Llama-3.2-1B, d 64: 0.1466 / 0.1290; Gemma-3-12B 0.490 / 0.466; in tiles Qwen3-8B 0.2234 / 0.2164)."""
    return not value_tiles and head_dim == 128 and heads_per_program == 4 and value_groups == 2


def keys_ahead(head_dim: int, heads_per_program: int, token_block: int, key_groups: int,
               value_tiles: bool = False) -> bool:
    """Whether the Gluon programs load each tile's key words during the tile before: the first key product waited on
    them (ncu, Qwen3-8B 100K x 8: 14% of the stall samples on that instruction), but the words hold registers
    through the tile. The 4-head programs have them to spare, but for the 128-register one with two key groups a
    token (it spills) and head_dim 256 with keys per channel (H100, 100K x 8, in the tile / ahead: Gemma-3-12B 0.463
    / 0.445 ms, SmolLM2 0.0683 / 0.0652; left out, Qwen3-8B 0.226 / 0.257). With the value codes in tiles also the
    8-head programs with keys per token or at head_dim 64, and head_dim 256 with keys per channel (H200, 100K x 8:
    GQA 8 0.2488 / 0.2379 ms, Gemma-3-12B keys per channel 0.503 / 0.478)."""
    if value_tiles and (heads_per_program == 8 and (token_block == 1 or head_dim == 64)):
        return True
    if value_tiles and head_dim == 256 and token_block > 1:
        return True
    return (heads_per_program == 4 and not (head_dim == 128 and token_block == 1 and key_groups == 2)
            and not (head_dim == 256 and token_block > 1))


def prefetch_tiles(head_dim: int, heads_per_program: int, token_block: int) -> int:
    """Tiles ahead (0: none) the Gluon programs hint into L2 during each tile (decode_gluon's PF): one, with keys per
    channel in the 8-head programs at head_dim 128 and at head_dim 64, which wait longest on their loads (H100, graph,
    none / one tile ahead: GQA 8 100K x 8 0.2816 / 0.2694 ms, 100K x 1 0.0664 / 0.0568; SmolLM2 100K x 8 0.0600 /
    0.0572). Elsewhere hints lose (Qwen3-8B keys per token 12-19% slower two tiles ahead)."""
    if token_block > 1 and (head_dim == 64 or (head_dim == 128 and heads_per_program == 8)):
        return 1
    return 0


def strided_tiles(head_dim: int, heads_per_program: int, token_block: int, value_tiles: bool = True) -> bool:
    """Whether Gluon split i of the A with rows takes tiles i, i + A, i + 2A, ... rather than a chunk of consecutive
    ones (decode_gluon's STRIDED): neighbouring programs on neighbouring tiles read 1-2.5% faster (bench/results/
    read_ceiling.md). H100, graph, chunks / strided: Qwen3-8B keys per token 100K x 8 0.2124 / 0.2081 ms, 100K x 1
    0.0492 / 0.0479; head_dim 64 Llama-3.2-1B 0.1188 / 0.1163, SmolLM2 0.0578 / 0.0564. Elsewhere it ties or loses
    (GQA 5 keys per channel 0.2601 / 0.2767). With the value codes in tiles only: in rows the 4-head head_dim 128
    program spills strided."""
    return value_tiles and (head_dim == 64 or (head_dim == 128 and heads_per_program == 4 and token_block == 1))


def gluon_registers(head_dim: int, token_block: int, heads_per_program: int) -> int | None:
    """Registers a thread the Gluon programs are held to (None: ptxas's choice): 128 at head_dim 64 with keys per
    channel (ptxas picks up to 168; at 128 they run 10-25% faster with no spills, H100 100K x 8) and for the 4-head
    programs with keys per token at head_dim 128 (168 leave 12 programs a multiprocessor, 5% slower than 16 at 128,
    which spill nothing; with groups of 128 it spills 24 bytes and still runs 5% faster)."""
    if (head_dim == 64 and token_block > 1) or (head_dim == 128 and token_block == 1 and heads_per_program == 4):
        return 128
    return None


def resident_warps(regs: int, shared: int, smem_per_sm: int) -> int:
    """One-warp programs of `regs` registers a thread and `shared` bytes that a Hopper multiprocessor holds at once
    (at most 32). A warp's registers come from the file of one of its 4 schedulers, 16,384 each, in steps of 8 a
    thread: 4·⌊16384 / (32·regs)⌋, not ⌊65536 / (32·regs)⌋ (at 96 registers 20, not 21: a grid sized for 21 ran a
    second wave, 0.232 against 0.161 ms at 100K x 8, d 64). Shared memory, less the 1 KiB the driver keeps a program,
    is shared among them."""
    regs = -(-regs // 8) * 8
    return max(1, min(32, 4 * (16384 // (32 * regs)), smem_per_sm // (shared + 1024)))


def plan_splits(batch: int, kv_heads: int, max_int2: int, block_n: int, num_sms: int, waves: int = 4,
                min_chunk: int = 0) -> tuple[int, int]:
    """(chunk, number of INT2 splits a pair): INT2 rows per split (a multiple of block_n, at least min_chunk), and as
    many splits as keep the programs within `waves` a multiprocessor (rounded down, so a `waves` equal to the programs
    one multiprocessor holds makes one whole wave, not one and a sliver)."""
    want = max(1, waves * num_sms // (batch * kv_heads))
    chunk = max(block_n, min_chunk, -(-max(max_int2, 1) // want))
    chunk = -(-chunk // block_n) * block_n
    return chunk, -(-max_int2 // chunk)


def gluon_waves(pairs: int, max_int2: int, head_dim: int, slots: int, ht: int, num_sms: int, min_chunk: int) -> int:
    """Gluon INT2 splits a multiprocessor (a split is ht programs; slots: the programs one multiprocessor holds). One
    whole wave, but at head_dim 64 and 128 for 16 pairs or fewer (H100, graph):
    - from 64K INT2 rows at 8 pairs or fewer, one program a multiprocessor fewer: the window programs, on a stream of
      their own in a graph, then start beside the INT2 programs (100K x 1: Qwen3-8B 0.0546 -> 0.0514 ms, GQA 16
      0.0722 -> 0.0619; at 16 pairs 3-14% slower);
    - where a whole wave's programs would read 256 rows or fewer each, 3/4 of the slots (Qwen3-8B 32K x 1 0.0330 ->
      0.0293, 16K x 2 0.0339 -> 0.0303); longer programs lose with it (100K x 1 0.0502 -> 0.0524).
    At head_dim 256, 8 programs a multiprocessor of longer tiles, a whole wave won (100K x 8 0.0956 against 0.0983
    ms with the spare slot)."""
    if pairs <= 16 and head_dim <= 128:
        if pairs <= 8 and max_int2 >= 65536:
            return max(1, (slots - 1) // ht)
        chunk, _ = plan_splits(pairs, 1, max_int2, GLUON_TILE, num_sms, slots // ht, min_chunk)
        if chunk <= 256:
            return max(1, slots * 3 // 4 // ht)
    return max(1, slots // ht)


def tma_stages(major: int, shape: DecodeShape, heads_per_program: int, rows: int) -> int:
    """Stages of the TMA ring through which the Gluon programs read their tiles (decode_gluon's TMA; 0: loads into
    registers). A program issues each tile's two bulk copies (TMA: compute capability 9 on) two tiles ahead and reads
    its operands from shared memory, so its loop waits on no global load; the outputs are the loads', bit for bit.
    Only with value groups of 64 and the value codes in tiles, not in a window's store. rows: INT2 rows a program
    reads. H100, graph, loads / ring, µs (bench/results/tma_ring*):
    - keys per channel in blocks of a tile, 4 or 8 heads a program: everywhere (Qwen3-8B 100K x 8 228.7 / 216.5,
      100K x 1 52.6 / 52.0; GQA 8 100K x 8 263.0 / 232.6); at head_dim 256 from 256 rows a program (Gemma 3 270M
      100K x 8 90.2 / 80.9, but 100K x 1, 128 rows, 36.1 / 40.6);
    - keys per token in groups of 64 at head_dim 128: with 4 heads a program from 128 pairs or 2,048 rows (Qwen3-8B
      100K x 32 760.8 / 728.8, 32K x 8 85.0 / 88.4, 100K x 1 47.4 / 48.6: there the two-tile prologue is not hidden),
      with 8 from 768 rows (GQA 8 16K x 8 67.8 / 61.9); at head_dim 64 with 4 heads everywhere (Llama-3.2-1B 100K x 8
      116.3 / 112.3); at 256 from 64 pairs or 2,048 rows (Gemma 3 12B 100K x 8 385.5 / 367.3; 270M 32K x 8 44.2 /
      48.7).
    Three and four stages hold more shared memory, so fewer programs fit a multiprocessor, and lose."""
    d, tb = shape.head_dim, shape.token_block
    if major < 9 or d not in (64, 128, 256) or shape.value_group != 64 or not shape.value_tiles or shape.window:
        return 0
    if tb == GLUON_TILE and d == 256:
        return 2 if rows >= 256 else 0
    if tb == GLUON_TILE and heads_per_program in (4, 8):
        return 2
    if tb > 1 or shape.key_group != 64:
        return 0
    if d == 256:
        return 2 if shape.pairs >= 64 or rows >= 2048 else 0
    if d == 64:
        return 2 if heads_per_program == 4 else 0
    if heads_per_program == 8:
        return 2 if rows >= 768 else 0
    return 2 if heads_per_program == 4 and (shape.pairs >= 128 or rows >= 2048) else 0


def flat_splits(pairs: int, splits_a_wave: int, ring: bool = False) -> bool:
    """Whether the Gluon programs take their rows flat (decode_gluon's FLAT) rather than in whole splits a pair: where
    whole splits, ⌊S / pairs⌋ a pair of the S a wave holds, would leave more than 8% of the wave idle; 12% where they
    would read through the TMA ring (ring), which flat rows do not and which gains 3-5%. Flat rows cost about 4%
    where nothing idles, so they pay only where more does. H100, Qwen3-8B's shape, graph, whole splits / flat, µs:
    100K x 30 (1,920 of 2,112 busy) 757.9 / 741.2; 100K x 32 (2,048) 774.8 / 789.7; GQA 8 100K x 30 874.9 / 824.3;
    against the ring, flat / ring: 100K x 30 (9.1% idle) 740.4 / 731.3, 100K x 55 (16.7%) 1312.2 / 1413.1."""
    idle = splits_a_wave - pairs * (splits_a_wave // pairs)
    return pairs < splits_a_wave and idle > (0.12 if ring else 0.08) * splits_a_wave


def flat_programs_a_pair(splits_a_wave: int, pairs: int) -> int:
    """The most flat programs that meet one pair: a pair's P units span ⌈P / Q⌉ programs of Q units, and one more
    where neither of its ends falls on a program's edge."""
    return -(-splits_a_wave // pairs) + 1


def reduce_columns(pairs: int, head_dim: int) -> int:
    """Columns of õ a reduce program merges and rotates: 8 where 16 would give 64 programs or fewer, twice the
    programs (H100, graph: 32K x 1 and 100K x 1 1-3% faster; Qwen2.5-0.5B 100K x 8 50.0 -> 49.0 µs; from 128
    programs no faster). Not 4: with 16 heads a KV head its programs gave wrong outputs on the H100 (triton 3.6),
    and it was no faster elsewhere."""
    return min(head_dim, 8 if pairs <= 8 or pairs * head_dim // 16 <= 64 else 16)


def reduce_heads(heads_per_kv: int, programs: int) -> int:
    """Query heads a reduce program merges: the fewest (from 2) that keep the reduce within 512 programs, where
    `programs` is its grid with all of a KV head's heads in each (pairs x column blocks). One program for all 16
    heads of GQA 16 at batch 1 took 9.5-15 µs, serial steps over the splits' partials of 16 heads at a time; 4 or 2
    heads a program 4.4-5.5 (H200, bench/results/reduce_heads_h200.txt). Past 512 programs more of them lose
    (Qwen3-8B 100K x 8: 7.0 µs at 512 programs, 9.5 at 1,024)."""
    hgp = pow2(heads_per_kv)
    hb = min(2, hgp)
    while hb < hgp and programs * (hgp // hb) > 512:
        hb *= 2
    return hb


def rotate_heads(heads_per_kv: int) -> int:
    """Query heads a rotation program takes: at most 4. Its [heads, d, 16] float32 product over all 16 heads of GQA
    16 took 2.8 µs at batch 1, over 4 heads a program 1.7; GQA 8 2.3 -> 1.9 at batch 1, 16.0 -> 14.2 at 32; 2 heads
    gain no more and lose at batch 8-32 (H200, bench/results/rotate_heads_h200.txt)."""
    return min(pow2(heads_per_kv), 4)


def gated_loads(splits: int) -> bool:
    """Whether the reduce loads a split's partials only where its l_s says it has rows (else beside l_s, and drops
    them): up to 64 splits a pair. Beyond, loaded beside (H100, graph, 100K x 8: Qwen2.5-0.5B's 136 splits 0.0580 ->
    0.0566 ms; at Qwen3-8B's 38 splits 0.1-1.2% slower). Read at launch, from the splits the grid has."""
    return pow2(splits) <= 64


def window_programs(shape: DecodeShape, block_w: int = 64) -> int:
    """Window programs a pair: the BF16 sink and ring in tiles of block_w tokens."""
    return -(-(shape.sink + shape.ring_slots) // block_w)


def gluon_constexprs(shape: DecodeShape, plan: DecodePlan) -> dict:
    """decode_gluon._int2_split_kernel's constexprs for a plan: HT programs of R4 query heads each cover a KV head's
    HG heads."""
    d, tb, hg = shape.head_dim, shape.token_block, shape.heads_per_kv
    return dict(HKV=shape.kv_heads, HG=hg, R4=plan.gluon_heads, S=shape.sink, W=shape.recent,
                NW=window_programs(shape, plan.block_w), BLOCK_N=GLUON_TILE,
                NGK=d // shape.key_group if tb == 1 else 1, NGV=d // shape.value_group, TB=tb,
                HT=-(-hg // plan.gluon_heads), D=d, MASK_ALL=plan.mask_all, KEYS_AHEAD=plan.keys_ahead,
                VT=shape.value_tiles, SLIDE=shape.window, HOLE=shape.hole, PF=plan.prefetch, STRIDED=plan.strided,
                FLAT=plan.flat, TMA=plan.tma, PDL=plan.pdl)


def gluon_options(plan: DecodePlan) -> dict:
    """The Gluon programs' compile options: one warp, held to plan.maxnreg registers where the rule says."""
    return dict(num_warps=1) if plan.maxnreg is None else dict(num_warps=1, maxnreg=plan.maxnreg)


def choose_plan(shape: DecodeShape, device: Device, max_length: int | None = None, *, gluon: bool | None = None,
                heads_per_program: int | None = None, flat: bool | None = None,
                pdl: bool | None = None) -> DecodePlan:
    """The plan of a decode call of this shape on this device, every rule applied in the order of docs/kernels.md's
    table. max_length: the longest sequence expected (None: the store's capacity), which sizes the INT2 splits.
    gluon, heads_per_program, flat, pdl: that choice pinned (None: the rule's), the rules after it following it.
    Raises ValueError for a shape no program serves (shape_problem) and for a pin the device or shape refuses."""
    problem = shape_problem(shape.heads, shape.kv_heads, shape.head_dim, shape.key_group, shape.value_group,
                            shape.key_axis)
    if problem is not None:
        raise ValueError(problem)
    pairs, d, hg, tb = shape.pairs, shape.head_dim, shape.heads_per_kv, shape.token_block
    max_int2 = shape.max_int2(max_length)
    why = gluon_problem(shape, device)
    if gluon is None:
        gluon = why is None and use_gluon(shape, max_int2)
    elif gluon and why is not None:
        raise ValueError(f"the Gluon INT2 programs cannot serve this call: {why}")
    if flat and not gluon:
        raise ValueError("flat rows are the Gluon INT2 programs'")
    if pdl is None:
        pdl = use_pdl(pairs, gluon, device)
    elif pdl and not programmatic_launch(device):
        raise ValueError("programmatic dependent launch needs a CUDA GPU of compute capability 9.0 or newer")
    cfg = program_config(pairs, d, gluon)
    block_c = reduce_columns(pairs, d)
    plan = DecodePlan(gluon=gluon, pdl=pdl, block_n=cfg["block_n"] if tb == 1 else min(cfg["block_n"], tb),
                      num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], waves=cfg["waves"],
                      min_chunk=cfg["min_chunk"], key_t=cfg["key_t"],
                      window_warps=window_warps(pairs, d, gluon, cfg["num_warps"]), block_c=block_c,
                      reduce_heads=reduce_heads(hg, pairs * (d // block_c)), rotate_heads=rotate_heads(hg),
                      use_asm=device.cuda)
    if not gluon:
        return plan
    r4 = gluon_heads(hg, d, heads_per_program)
    ngk, ngv = d // shape.key_group if tb == 1 else 1, d // shape.value_group
    plan = dataclasses.replace(
        plan, min_chunk=gluon_min_chunk(max_int2, cfg["min_chunk"]), gluon_heads=r4,
        mask_all=mask_every_tile(d, r4, ngv, shape.value_tiles),
        keys_ahead=keys_ahead(d, r4, tb, ngk, shape.value_tiles), prefetch=prefetch_tiles(d, r4, tb),
        strided=strided_tiles(d, r4, tb, shape.value_tiles), maxnreg=gluon_registers(d, tb, r4))

    def slots(p: DecodePlan) -> int:
        return device.slots(gluon_constexprs(shape, p), gluon_options(p))

    held = slots(plan)
    plan = dataclasses.replace(plan, waves=gluon_waves(pairs, max_int2, d, held, -(-hg // r4), device.sms,
                                                       plan.min_chunk))
    chunk, splits = plan_splits(shape.batch, shape.kv_heads, max_int2, plan.block_n, device.sms, plan.waves,
                                plan.min_chunk)
    wave = plan.waves * device.sms
    # The TMA ring, only where it leaves the programs a multiprocessor holds as they were (the grid is sized for them).
    ring = None
    stages = tma_stages(device.major, shape, r4, chunk)
    if stages and shape.joint:
        ring = dataclasses.replace(plan, tma=stages, keys_ahead=False, prefetch=0)    # the ring holds them already
        if slots(ring) != held:
            ring = None
    if flat is None:
        # Where the wave, not min_chunk, bounds the splits, at head_dim 64 and 128 (at 256 the flat programs spill 16
        # bytes, not 8: not measured), and only where they fit a multiprocessor as many to one (the wave's size).
        flat = (d <= 128 and max(splits, 1) == wave // pairs and flat_splits(pairs, wave, ring is not None)
                and slots(dataclasses.replace(plan, flat=True, strided=False)) >= held)
    if flat:
        return dataclasses.replace(plan, flat=True, strided=False)
    return ring or plan


def check_plan(shape: DecodeShape, plan: DecodePlan, device: Device) -> None:
    """Raise ValueError unless the programs can run this plan for a call of this shape on this device."""
    problem = shape_problem(shape.heads, shape.kv_heads, shape.head_dim, shape.key_group, shape.value_group,
                            shape.key_axis)
    if problem is not None:
        raise ValueError(problem)
    if plan.gluon and (why := gluon_problem(shape, device)) is not None:
        raise ValueError(f"the Gluon INT2 programs cannot serve this call: {why}")
    if plan.pdl and not programmatic_launch(device):
        raise ValueError("programmatic dependent launch needs a CUDA GPU of compute capability 9.0 or newer")
    if plan.flat and (not plan.gluon or plan.tma):
        raise ValueError("flat rows are the Gluon INT2 programs' without their TMA ring")
    if plan.tma and not (plan.gluon and device.major >= 9 and shape.joint):
        raise ValueError("the TMA ring needs the Gluon INT2 programs on compute capability 9.0 or newer and a store "
                         "laid out as kvstore.empty_cache lays it")
