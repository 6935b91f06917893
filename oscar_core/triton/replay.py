"""CUDA-graph replay of a decode call's launches, the graphs kept on the store they read.

An eager decode call on CUDA spends more host time launching its three or four programs than they run at short
contexts. decode.decode_attention and decode.decode_step hand their launches to replay(), which captures them once
per key (graph_key: every address and setting the launches depend on besides their inputs' and output's) and replays
the graph after. The graphs live in the store's `graphs` dict, so they never outlive the tensors they read.
(oscar_core.serve.decode_graph is another thing: a whole model's decode step captured as one graph.)
"""

import collections
import dataclasses

import torch

GRAPHS_PER_STORE = 4     # each holds its own work buffers (a private memory pool)
DIRECT_GRAPHS = 2        # graphs at the caller's own addresses, per graph kept on the store; the calls looked back on
STORE_FIELDS = ("key_sink", "value_sink", "key_recent", "value_recent", "key_codes", "key_scale", "key_zero",
                "value_codes", "value_scale", "value_zero", "lengths")
PAGE_FIELDS = ("block_table", "window_slot")       # a paged store's (paged.PagedKVCache)


@dataclasses.dataclass
class Replays:
    """The CUDA graphs of one setting of a call over one store (replay)."""
    graph: torch.cuda.CUDAGraph     # reads inputs, writes o
    inputs: tuple
    o: torch.Tensor
    direct: dict = dataclasses.field(default_factory=dict)  # the call's addresses -> graph reading, writing there
    recent: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=DIRECT_GRAPHS))


def graph_key(q, out, cache, key_rotation, value_rotation, value_mean, scaling, settings: tuple) -> tuple:
    """What a graph of a decode call over cache depends on: everything it reads by address (the store's tensors, the
    rotations, the mean), q's and out's shape and dtypes, and the call's launch settings (settings: its rounded
    max_length and plan)."""
    mean_ptr = None if value_mean is None else value_mean.data_ptr()
    rv_ptr = None if value_rotation is None else value_rotation.data_ptr()
    return (tuple(q.shape), q.dtype, q.device, out.dtype, key_rotation.data_ptr(), rv_ptr, mean_ptr, scaling,
            settings, tuple(getattr(cache, f).data_ptr() for f in STORE_FIELDS + PAGE_FIELDS if hasattr(cache, f)))


def graph_of(launches, device, pool=None) -> torch.cuda.CUDAGraph:
    """A CUDA graph of what launches() launches, captured on a side stream (in the memory pool of a graph never
    replayed at the same time, or None: a pool of its own)."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        launches()
        graph.capture_end()
    torch.cuda.current_stream(device).wait_stream(stream)
    return graph


def replay(graphs: dict, key: tuple, launches, inputs: tuple, out: torch.Tensor) -> torch.Tensor:
    """launches(*inputs, out) as one CUDA-graph replay; key: what the launches depend on besides the inputs' and
    out's addresses (graph_key). The graph is captured after the first direct call of a key, on inputs and an
    output of its own, and kept in graphs (a store's, so it never outlives the tensors it reads); the
    GRAPHS_PER_STORE latest keys are kept. A call copies its inputs into the graph's, replays it and copies its
    output out, unless its inputs and out are where one of the DIRECT_GRAPHS calls before had them (a caller with
    fixed buffers, or an allocator handing the same blocks back, every step or every other step): then a graph
    reading those inputs and writing that out is captured, and calls at those addresses replay it alone. A copy
    costs more host time than the replay (H200: 7-11 µs each against 3-6, bench/results/eager_parts_h200.txt), so
    the inputs go in one launch. Calls on one stream at a time."""
    tensors = inputs + (out,)
    where = tuple(t.data_ptr() for t in tensors) if all(t.is_contiguous() for t in tensors) else None
    hit = graphs.get(key)
    if hit is None:
        launches(*inputs, out)
        while len(graphs) >= GRAPHS_PER_STORE:    # the oldest goes (a context that grew past its bucket)
            graphs.pop(next(iter(graphs)))
        own, o = tuple(t.clone(memory_format=torch.contiguous_format) for t in inputs), torch.empty_like(out)
        hit = graphs[key] = Replays(graph_of(lambda: launches(*own, o), out.device), own, o)
        hit.recent.append(where)
        return out
    direct = hit.direct.get(where)
    if direct is not None:
        direct.replay()
        return out
    torch._foreach_copy_(hit.inputs, inputs)
    hit.graph.replay()
    out.copy_(hit.o)
    if where is not None and where in hit.recent:
        while len(hit.direct) >= DIRECT_GRAPHS:
            hit.direct.pop(next(iter(hit.direct)))
        hit.direct[where] = graph_of(lambda: launches(*inputs, out), out.device, hit.graph.pool())
    hit.recent.append(where)
    return out
