"""Where an eager decode call's time goes at batch 1: wall clock per call of 300 back-to-back calls, in µs, when the
last call is issued and when the GPU has finished, for the whole call and for each of its pieces as the copying graph
runs them (decode._replayed before the graphs at the caller's addresses): the key built in Python, q's copy into the
graph, the replay, the copy of the output out (or a clone, for out=None).

    PYTHONPATH=. python3 bench/eager_parts.py > bench/results/eager_parts_h200.txt

Arms: sdpa (bf16 SDPA), call (decode_attention with out), call_noout (without), direct (graph=False: the launches),
copy_in, replay, copy_out, clone, three (copy in, replay, copy out with no Python key), capturing
(torch.cuda.is_current_stream_capturing), key (decode.graph_key and the lookup).
Run before the graphs at the caller's addresses (session 37's first call), so 'call' is the copying path there; with
them, 'call' replays a graph of its own after two calls (bench/eager_small.py times both).
"""
import sys
import time

import torch

sys.path.insert(0, "bench")
import shapes  # noqa: E402

from oscar_core.triton import decode  # noqa: E402

CLASSES = ["Qwen3-8B 32/8 d128", "Llama-3.2-1B 32/8 d64", "Qwen2.5-0.5B 14/2 d64, keys per channel",
           "Qwen2.5-7B 28/4 d128 (GQA 7), keys per channel", "GQA 16 32/2 d128"]


def wall(fn, calls=300) -> tuple:
    """(µs a call to issue, µs a call to finish) over calls back-to-back calls."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter() - t
    torch.cuda.synchronize()
    return issued / calls * 1e6, (time.perf_counter() - t) / calls * 1e6


def main():
    gen = torch.Generator("cuda").manual_seed(0)
    for context in (8192, 16384):
        for label, heads, kv, d, gk, gv, axis in [s for s in shapes.SHAPES if s[0] in CLASSES]:
            layer = shapes.layer_of(kv, d, gen)
            cache = shapes.random_store(1, kv, d, context, gk, gv, axis, gen)
            q = torch.randn(1, heads, d, generator=gen, device="cuda").bfloat16()
            out = torch.empty_like(q)
            args = (q, cache, layer.key_rotation, layer.value_rotation, layer.value_mean, d ** -0.5)
            decode.decode_attention(*args, max_length=context, out=out)
            replays = list(cache.graphs.values())[-1]
            graph, (q_in,), o = replays.graph, replays.inputs, replays.o
            sdpa = shapes.sdpa_call(q, kv, context, gen)

            def key_only():
                options = dict(max_length=decode._pow2(context), block_n=None, block_w=64, num_warps=None,
                               num_stages=None, waves=None, use_asm=None, key_t=None, fused=False, gluon=None,
                               heads_per_program=None, pdl=None, flat=None)
                return cache.graphs.get(decode.graph_key(q, out, *args[1:], options))

            rows = dict(sdpa=wall(sdpa), call=wall(lambda: decode.decode_attention(*args, max_length=context, out=out)),
                        call_noout=wall(lambda: decode.decode_attention(*args, max_length=context)),
                        direct=wall(lambda: decode.decode_attention(*args, max_length=context, out=out, graph=False)),
                        copy_in=wall(lambda: q_in.copy_(q)), replay=wall(graph.replay),
                        copy_out=wall(lambda: out.copy_(o)), clone=wall(o.clone),
                        three=wall(lambda: (q_in.copy_(q), graph.replay(), out.copy_(o))),
                        capturing=wall(torch.cuda.is_current_stream_capturing), key=wall(key_only))
            print(f"{label} {context} x 1 (us, issue / total): "
                  + ", ".join(f"{k} {a:.1f}/{b:.1f}" for k, (a, b) in rows.items()), flush=True)
            del sdpa
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
