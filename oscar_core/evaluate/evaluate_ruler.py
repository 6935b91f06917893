"""`oscar eval --suite ruler`: the RULER-style tasks of ruler.py answered greedily through every method's KV cache.

At each context L, each task's prompts 0..samples−1 (ruler.sample, seeded) are answered by
perplexity.greedy_answers (one exact prefill, then model.generate through each method's OscarCache) and scored by
ruler.string_match_all:
    score(method, L, task) = mean over the task's prompts of the fraction of expected strings in the answer
    average(method, L)     = mean over the tasks that fit L
A task whose prompt without haystack does not fit L is left out at L (report["skipped"]); a length that no task
fits is an error, raised before any answer is generated.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from oscar_core.calibrate.data import DEFAULT_HELDOUT
from oscar_core.errors import UsageError
from oscar_core.evaluate.perplexity import check_bundle, check_lengths, greedy_answers
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


def evaluate_ruler(loaded, bundle, req: RulerRequest, on_step: Callable[[str], None] | None = None) -> dict:
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
              "labels": {m: methods.LABELS[m] for m in req.methods}, "samples": req.samples,
              "bits_per_element": {m: {str(c): round(methods.bits_per_element(m, c, bundle), 4) for c in req.contexts}
                                   for m in req.methods},
              "prompts": {str(c): {t: req.samples for t in fits[c]} for c in req.contexts},
              "skipped": {str(c): skipped[c] for c in req.contexts},
              "scores": {m: {str(c): {} for c in req.contexts} for m in req.methods},
              "average": {m: {} for m in req.methods}, "answers": [], "timings_s": {}}
    for c in req.contexts:
        t0 = time.perf_counter()
        for task in fits[c]:
            total = dict.fromkeys(req.methods, 0.0)
            for i in range(req.samples):
                s = sample(task, tok, hay, c, req.seed, i)
                step(f"ruler {task} @ {c}, prompt {i + 1} of {req.samples}")
                answers = greedy_answers(model, tok, s.ids, req.methods, bundle, loaded.info.num_layers,
                                         s.max_new_tokens)
                for m, (text, *_) in answers.items():
                    score = string_match_all(text, s.expected)
                    total[m] += score
                    report["answers"].append({"context": c, "task": task, "sample": i, "prompt_tokens": s.ids.numel(),
                                              "method": m, "expected": list(s.expected), "answer": text.strip(),
                                              "score": score})
            for m in req.methods:
                report["scores"][m][str(c)][task] = total[m] / req.samples
        for m in req.methods:
            per_task = report["scores"][m][str(c)]
            report["average"][m][str(c)] = sum(per_task.values()) / len(per_task)
        report["timings_s"][str(c)] = round(time.perf_counter() - t0, 1)
    return report
