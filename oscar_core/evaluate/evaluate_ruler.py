"""`oscar eval --suite ruler`: the RULER-style tasks of ruler.py answered greedily through every method's KV cache.

At each context L, each task's prompts 0..samples−1 (ruler.sample, seeded) are answered `batch` at a time by
perplexity.batch_answers (each prompt prefilled exactly, then one model.generate of the left-padded batch through
each method's OscarCache: a prompt's answer is the one it gets alone, up to float reduction order) and scored by
ruler.string_match_all:
    score(method, L, task) = mean over the task's prompts of the fraction of expected strings in the answer
    average(method, L)     = mean over the tasks that fit L
A task whose prompt without haystack does not fit L is left out at L (report["skipped"]); a length that no task
fits is an error, raised before any answer is generated. on_step hears the prompts under way, a line of scores for
each finished (L, task), and the report so far after each finished L (perplexity.Step).
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from oscar_core.calibrate.data import DEFAULT_HELDOUT
from oscar_core.errors import UsageError
from oscar_core.evaluate.perplexity import Step, batch_answers, check_bundle, check_lengths, in_batches
from oscar_core.evaluate.ruler import TASKS, DoesNotFit, haystack, sample, string_match_all
from oscar_core.serve import methods

CUDA_SAMPLES, CPU_SAMPLES = 50, 4


@dataclass
class RulerRequest:
    contexts: list[int] = field(default_factory=lambda: [4096])
    methods: list[str] = field(default_factory=lambda: list(methods.METHODS))
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    data: str = DEFAULT_HELDOUT
    samples: int = CPU_SAMPLES
    seed: int = 0
    batch: int = 1      # prompts answered together (perplexity.default_batch)


def default_samples(device: str) -> int:
    """Prompts per task per length unless asked otherwise: CUDA_SAMPLES on a GPU, CPU_SAMPLES on the CPU."""
    return CUDA_SAMPLES if str(device).startswith("cuda") else CPU_SAMPLES


def check_request(req: RulerRequest, bundle, max_context: int | None = None) -> None:
    """One-line UsageErrors for bad contexts, methods, tasks or sample counts (before any model is loaded)."""
    check_lengths(req.contexts, req.methods, bundle, max_context)
    unknown = [t for t in req.tasks if t not in TASKS]
    if unknown or not req.tasks:
        raise UsageError(f"unknown task {', '.join(unknown) or '(none given)'}: use some of {', '.join(TASKS)}")
    if req.samples < 1:
        raise UsageError("--samples must be positive")
    if req.batch < 1:
        raise UsageError("--batch must be positive")


def fitting_tasks(req: RulerRequest, tokenizer, hay) -> tuple[dict[int, list[str]], dict[int, dict[str, str]]]:
    """({L: tasks whose prompt 0 fits L}, {L: {task: why it does not}}); a UsageError where none fits a length, an
    OscarError where the haystack source is too short."""
    fits, skipped = {}, {}
    for c in req.contexts:
        fits[c], skipped[c] = [], {}
        for task in req.tasks:
            try:
                sample(task, tokenizer, hay, c, req.seed, 0)
                fits[c].append(task)
            except DoesNotFit as e:
                skipped[c][task] = str(e)
        if not fits[c]:
            raise UsageError(f"--context {c}: no task of the suite fits: {'; '.join(skipped[c].values())}")
    return fits, skipped


def evaluate_ruler(loaded, bundle, req: RulerRequest, on_step: Callable[[Step], None] | None = None) -> dict:
    """Score of every method on every task that fits every context, and their averages; the JSON-ready report."""
    check_bundle(bundle, loaded.info, loaded.model.config)
    check_request(req, bundle, loaded.info.max_position_embeddings)
    model, tok = loaded.model, loaded.tokenizer
    step = on_step or (lambda s: None)
    hay = haystack(req.data, tok, max(req.contexts))
    fits, skipped = fitting_tasks(req, tok, hay)
    report = {"suite": "ruler", "model": loaded.info.id, "bundle": f"{bundle.manifest.name} {bundle.manifest.version}",
              "bundle_sha256": bundle.manifest.tensors.sha256, "data": req.data, "device": str(model.device),
              "seed": req.seed, "contexts": req.contexts, "methods": req.methods, "tasks": req.tasks,
              "labels": {m: methods.LABELS[m] for m in req.methods}, "samples": req.samples, "batch": req.batch,
              "bits_per_element": {m: {str(c): round(methods.bits_per_element(m, c, bundle), 4) for c in req.contexts}
                                   for m in req.methods},
              "prompts": {str(c): {t: req.samples for t in fits[c]} for c in req.contexts},
              "skipped": {str(c): skipped[c] for c in req.contexts},
              "scores": {m: {str(c): {} for c in req.contexts} for m in req.methods},
              "average": {m: {} for m in req.methods}, "answers": [], "timings_s": {}, "finished": []}
    for c in req.contexts:
        t0 = time.perf_counter()
        for task in fits[c]:
            t1, total = time.perf_counter(), dict.fromkeys(req.methods, 0.0)
            prompts = [(i, sample(task, tok, hay, c, req.seed, i)) for i in range(req.samples)]
            for batch in in_batches(prompts, req.batch, key=lambda p: p[1].max_new_tokens):
                step(Step(f"ruler {task} @ {c}, prompts {batch[0][0] + 1}-{batch[-1][0] + 1} of {req.samples}"))
                answers = batch_answers(model, tok, [s.ids for _, s in batch], req.methods, bundle,
                                        loaded.info.num_layers, batch[0][1].max_new_tokens)
                for (i, s), per_method in zip(batch, answers):
                    for m, (text, *_) in per_method.items():
                        score = string_match_all(text, s.expected)
                        total[m] += score
                        report["answers"].append({"context": c, "task": task, "sample": i,
                                                  "prompt_tokens": s.ids.numel(), "method": m,
                                                  "expected": list(s.expected), "answer": text.strip(),
                                                  "score": score})
            for m in req.methods:
                report["scores"][m][str(c)][task] = total[m] / req.samples
            step(Step(f"ruler @ {c} {task}: " + ", ".join(f"{m} {report['scores'][m][str(c)][task]:.1%}"
                                                         for m in req.methods)
                      + f" ({req.samples} prompts, {time.perf_counter() - t1:.1f} s)", done=True))
        for m in req.methods:
            per_task = report["scores"][m][str(c)]
            report["average"][m][str(c)] = sum(per_task.values()) / len(per_task)
        report["timings_s"][str(c)] = round(time.perf_counter() - t0, 1)
        report["finished"].append(c)
        step(Step(f"ruler @ {c} average: " + ", ".join(f"{m} {report['average'][m][str(c)]:.1%}"
                                                      for m in req.methods)
                  + f" ({report['timings_s'][str(c)]} s)", done=True, report=report))
    return report
