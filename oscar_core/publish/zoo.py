"""The zoo: one recipe per model, the bundles built from them, and a copy of every bundle's manifest.

    zoo/recipes/<file>.toml          a Recipe: what to calibrate, how, and the bundle's name and version
    zoo/<org>/<model>/<version>/     the bundle built from it (rotations.safetensors + manifest.json)
    manifests/<org>/<model>/<version>.json   the bundle's manifest, byte for byte

A recipe builds only where its model is available (the default model's package is installed, the
directory exists, the hub weights are cached or the hub is reachable) and its device exists.

The reproducibility contract, kept by `check`, which rebuilds into a temporary directory:
- same machine and software: the rebuild is byte-identical ("same");
- any other machine: the rebuild must be numerically equivalent ("equivalent", else "differs"): the manifest
  identical apart from checksum, provenance (platform, model source) and the mean clips, every clip the rebuild's
  own or a near tie of its search, every other tensor within the tolerances of oscar_core/equivalence.py, and,
  when `oscar verify --record` left a verify.json, the rebuild's verify figures within VERIFY_MARGINS of it.
"""

import tempfile
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from oscar_core.equivalence import (COVARIANCE_OF, Deviation, clip_excess, figure_deviations, json_differences, kind_of,
                                    tensor_deviations)
from oscar_core.errors import OscarError
from oscar_core.formats.bundle import (MANIFEST_FILE, TENSOR_FILE, Bundle, Manifest, bundle_layers, plain_name,
                                       schema_errors)
from oscar_core.formats.fileio import atomic_write_bytes, path_under

RECIPES_DIR = "recipes"
BUNDLE_FILES = (TENSOR_FILE, MANIFEST_FILE)
LOCAL_DATA = ("default", "default-heldout")
PROVENANCE = ("tensors.sha256", "calibration.platform", "calibration.model_source")  # may differ between machines
CLIP_MEANS = ("quant.key_clip", "quant.value_clip")  # follow the clips, held to their own rule
# |committed − rebuilt| allowed per verify figure. Measured across instruction sets
# (bench/results/reproducibility.md): the errors did not move at the recorded 4 digits, KL moved 2e-4, top-1 agreement one token in 1,023 (9e-4);
# margins are about 10x that (10 rounding steps for the errors). Seeds move these figures little (<= 2e-3):
# verify shows the rebuild performs as recorded; telling seeds apart is the tensors' job. The attention errors take
# the margins of their kin (KIVI-style KL: below). Perplexities compare as |log ratio| (mean NLL, nats): the INT2 arm's
# moved 2.3e-3 (Qwen2.5-Coder) and 1.9e-3 (SmolLM2) between the CI machine and ours while its KL did not move at
# 4 digits (a few codes flipping at the rounding edge shift NLL more than KL); the margin is about 10x that.
# The probe errors behind each layer's key format moved up to 1.3e-3 relative between instruction sets (avx512 vs
# avx2 / default, SmolLM2 and Qwen2.5-Coder zoo bundles); the format itself must not move.
# KIVI-style KL is the loosest figure: five times OSCAR's, and its quantized arm flips codes at rounding edges. Between
# the machine that committed SmolLM2's bundle and an Intel Xeon with AVX512 (session 38's CI) it moved 2.7e-3
# (0.1156 -> 0.1129 under avx2, 0.1130 natively; BF16 perplexity moved 3e-4 in log, OSCAR's KL 2e-4): its margin
# is 1e-2, under 9% of it.
LAYER_ERROR_TOLERANCE = 1e-2
VERIFY_MARGINS = {"logit_error": 1e-3, "hadamard_logit_error": 1e-3, "output_error": 1e-3,
                  "hadamard_output_error": 1e-3, "kl": 2e-3, "top1_agreement": 1e-2,
                  "attention_error": 1e-3, "kivi_attention_error": 1e-3, "hadamard_attention_error": 1e-3,
                  "kivi_kl": 1e-2, "ppl": 2e-2, "kivi_ppl": 2e-2, "bf16_ppl": 2e-2}

class Recipe(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())
    name: str = Field(pattern=r"^[\w.-]+/[\w.-]+$", description="<org>/<model>: where the bundle lives in the zoo")
    version: str = Field(pattern=r"^[\w.-]+$")
    model: str = Field(description="hub id, directory or .gguf file; 'default' for the embedded default model")
    data: str = "default"
    split: str = "train"
    text_field: str = "text"
    samples: int = Field(gt=0)
    seq_len: int = Field(gt=1)
    seed: int = 0
    batch_size: int = Field(1, gt=0)
    device: str | None = None
    dtype: str | None = None
    gpus: int = Field(1, gt=0, description="data-parallel calibration processes, one per GPU (torchrun)")

    @field_validator("name", "version")
    @classmethod
    def _plain(cls, value: str, info) -> str:
        return plain_name(value, f"recipe {info.field_name}")

    def calibration_fields(self) -> dict:
        return self.model_dump(exclude={"name", "version", "gpus"})


@dataclass(frozen=True)
class Outcome:
    """What happened to one recipe: status is built, skipped, same (byte-identical), equivalent, differs or
    missing; deviations are the equivalence measures of a rebuild that is not byte-identical."""
    recipe: Recipe
    status: str
    detail: str = ""
    deviations: tuple[Deviation, ...] = ()


def bundle_path(zoo_root: Path, recipe: Recipe) -> Path:
    return path_under(zoo_root, f"{recipe.name}/{recipe.version}", "recipe name")


def manifest_copy_path(manifests_root: Path, name: str, version: str) -> Path:
    return path_under(manifests_root, f"{name}/{version}.json", "bundle name")


def load_recipes(zoo_root: str | Path, required: bool = False) -> list[Recipe]:
    """Every recipe under zoo/recipes/, sorted by name; an unreadable one is an error naming its file.
    required: a missing zoo directory or one without recipes is an error (build and check must act on something)."""
    if required and not Path(zoo_root).is_dir():
        raise OscarError(f"zoo directory not found: {zoo_root}")
    if required and not any((Path(zoo_root) / RECIPES_DIR).glob("*.toml")):
        raise OscarError(f"no recipes in {Path(zoo_root) / RECIPES_DIR}: nothing to build or check")
    recipes = []
    for path in sorted((Path(zoo_root) / RECIPES_DIR).glob("*.toml")):
        try:
            with schema_errors(f"recipe {path}"):
                recipes.append(Recipe.model_validate(tomllib.loads(path.read_text())))
        except tomllib.TOMLDecodeError as e:
            raise OscarError(f"recipe {path}: not TOML ({e})") from None
    names = [(r.name, r.version) for r in recipes]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate:
        raise OscarError(f"two recipes build {duplicate[0]} {duplicate[1]}")
    return sorted(recipes, key=lambda r: (r.name, r.version))


def read_manifests(manifests_root: str | Path) -> list[Manifest]:
    """The manifest copies under manifests/, sorted by name and version."""
    out = []
    for path in sorted(Path(manifests_root).glob("*/*/*.json")):
        try:
            out.append(Manifest.model_validate_json(path.read_text()))
        except ValidationError as e:
            raise OscarError(f"invalid manifest copy {path}: {e.errors()[0]['msg']}") from None
    return sorted(out, key=lambda m: (m.name, m.version))


@cache
def hub_reachable() -> bool:
    """Whether the Hugging Face Hub answers (one quick request, remembered for the process)."""
    from huggingface_hub import HfApi

    try:
        HfApi().model_info("HuggingFaceTB/SmolLM2-135M-Instruct", timeout=5)
        return True
    except Exception:  # noqa: BLE001 - any failure means: not reachable from here
        return False


def missing_requirements(recipe: Recipe) -> list[str]:
    """Why this machine cannot build the recipe, one phrase per reason; empty when it can."""
    import torch

    from oscar_core.calibrate.models import resolve

    missing = []
    if (recipe.device or "").startswith("cuda") and not torch.cuda.is_available():
        missing.append("no CUDA GPU")
    elif (recipe.device or "").startswith("cuda") and torch.cuda.device_count() < recipe.gpus:
        missing.append(f"{recipe.gpus} GPUs needed, {torch.cuda.device_count()} here")
    try:
        target, _, weights = resolve(recipe.model)
    except OscarError as e:
        missing.append(str(e))
    else:
        if weights is None and not Path(target).is_dir() and not in_hf_cache(target) and not hub_reachable():
            missing.append(f"{target} is not in the local Hugging Face cache and the hub is unreachable")
    if recipe.data not in LOCAL_DATA and not Path(recipe.data).expanduser().exists() and not hub_reachable():
        missing.append(f"data {recipe.data} streams from the hub, which is unreachable")
    return missing


def skip_reason(missing: list[str]) -> str:
    return "not available here: " + "; ".join(missing)


def in_hf_cache(model_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(model_id, "config.json"), str)


def calibration_dir(work_dir: Path, recipe: Recipe) -> Path:
    return Path(work_dir) / recipe.name.replace("/", "--")


def build_one(recipe: Recipe, zoo_root: Path, manifests_root: Path, work_dir: Path,
              on_progress: Callable[[int, int, float], None] | None = None) -> Path:
    """Calibrate, export the bundle into zoo_root and copy its manifest into manifests_root."""
    from oscar_core.calibrate.calibration import CalibrationRequest, calibrate
    from oscar_core.calibrate.distributed import launch_calibration
    from oscar_core.calibrate.export import export_bundle

    calib_dir = calibration_dir(work_dir, recipe)
    request = CalibrationRequest(**recipe.calibration_fields())
    if recipe.gpus > 1:
        launch_calibration(request, calib_dir, recipe.gpus)
    else:
        calibrate(request, calib_dir, on_progress=on_progress)
    path, _ = export_bundle(calib_dir, zoo_root, recipe.version, name=recipe.name)
    atomic_write_bytes(manifest_copy_path(manifests_root, recipe.name, recipe.version),
                       (path / MANIFEST_FILE).read_bytes())
    return path


def select(recipes: list[Recipe], names: list[str] | None) -> list[Recipe]:
    """The recipes named (by bundle name), all when names is empty; an unknown name is an error."""
    if not names:
        return recipes
    unknown = sorted(set(names) - {r.name for r in recipes})
    if unknown:
        raise OscarError(f"no recipe builds {', '.join(unknown)}: the recipes build {', '.join(r.name for r in recipes)}")
    return [r for r in recipes if r.name in names]


def build(zoo_root: str | Path, manifests_root: str | Path,
          on_start: Callable[[Recipe], None] | None = None,
          on_progress: Callable[[int, int, float], None] | None = None, names: list[str] | None = None) -> list[Outcome]:
    """Rebuild every recipe (of `names`, if given) this machine can build; the others are skipped with the reason."""
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="oscar-zoo-") as work:
        for recipe in select(load_recipes(zoo_root, required=True), names):
            missing = missing_requirements(recipe)
            if missing:
                outcomes.append(Outcome(recipe, "skipped", skip_reason(missing)))
                continue
            if on_start:
                on_start(recipe)
            path = build_one(recipe, Path(zoo_root), Path(manifests_root), Path(work), on_progress)
            outcomes.append(Outcome(recipe, "built", str(path)))
    return outcomes


def differences(committed: Path, rebuilt: Path) -> list[str]:
    """The bundle files that are not byte-for-byte equal (or absent on one side)."""
    out = []
    for name in BUNDLE_FILES:
        a, b = committed / name, rebuilt / name
        if not a.is_file():
            out.append(f"{name} is not committed")
        elif not b.is_file() or a.read_bytes() != b.read_bytes():
            out.append(f"{name} differs")
    return out


def manifest_differences(committed: Manifest, rebuilt: Manifest) -> list[str]:
    """Where the manifests differ, apart from PROVENANCE, as one-line reasons. Each layer's key format must be the
    same; the probe errors that chose it (quant.layers[].errors, float64 measurements whose last digits move with
    the instruction set) must agree within LAYER_ERROR_TOLERANCE."""
    def comparable(m: Manifest) -> tuple[dict, list[dict]]:
        d = m.model_dump(mode="json")
        for path in PROVENANCE + CLIP_MEANS:
            section, key = path.split(".")
            d[section].pop(key, None)
        return d, [entry.pop("errors") for entry in d["quant"]["layers"] or []]

    (a, errors_a), (b, errors_b) = comparable(committed), comparable(rebuilt)
    out = [f"manifest {d}" for d in json_differences(a, b)]
    for entry, ea, eb in zip(a["quant"]["layers"] or [], errors_a, errors_b):
        far = [k for k in ea if k not in eb or abs(ea[k] - eb[k]) > LAYER_ERROR_TOLERANCE * max(abs(ea[k]), 1e-6)]
        if far or set(ea) != set(eb):
            out.append(f"manifest quant.layers: layer {entry['layer']}'s probe errors differ beyond "
                       f"{LAYER_ERROR_TOLERANCE:g} relative ({', '.join(far) or 'candidates'})")
    return out


def rebuild_measures(calib_dir: Path, committed: Bundle, rebuilt: Bundle) -> tuple[dict, dict]:
    """What the rebuild's statistics say about the committed tensors: (the rebuild's C_Q and C_S per layer, keyed by
    the rotation they belong to; the clip_excess of every clip that differs, on the rebuild's clip objectives).
    The zoo exports with the default DeriveOptions, so those are the objectives its search minimized."""
    from oscar_core.calibrate.calibration import read_record, read_statistics
    from oscar_core.calibrate.derive import DeriveOptions, clip_objectives
    from oscar_core.calibrate.export import layer_frequencies, served_options

    m = rebuilt.manifest
    stats, _ = read_statistics(calib_dir, m.model.num_heads)
    layers = bundle_layers(m)
    side = {"query": stats.query_covariance, "output": stats.score_weighted_value_covariance}
    covariances = {f"layers.{i}.{kind}": side[cov](i) for i in layers for kind, cov in COVARIANCE_OF.items()}
    differing = sorted(n for n, b in rebuilt.tensors.items() if kind_of(n).endswith("_clip")
                       and n in committed.tensors and committed.tensors[n].shape == b.shape
                       and not torch.equal(committed.tensors[n], b))
    if not differing:
        return covariances, {}
    frequencies = layer_frequencies(read_record(calib_dir))
    opts = served_options(DeriveOptions(), m.model, m.quant.sink_tokens, stats.probe(layers[0])["key"].shape[-2],
                          bool(frequencies))
    axes = {f.layer: f.key_axis for f in m.quant.layers or []}
    excesses = {}
    for name in differing:
        layer = int(name.split(".")[1])
        prefix = f"layers.{layer}."
        tensors = {n[len(prefix):]: t for n, t in rebuilt.tensors.items() if n.startswith(prefix)}
        objective = clip_objectives(stats, layer, tensors, opts, axes.get(layer, "token"), frequencies.get(layer))
        excesses[name] = clip_excess(objective[kind_of(name)], committed.tensors[name], rebuilt.tensors[name])
    return covariances, excesses


def clip_means_problems(bundle: Bundle) -> list[str]:
    """The manifest's mean clips (quant.key_clip, value_clip) against the bundle's own clips, as one-line reasons."""
    out = []
    for kind in ("key_clip", "value_clip"):
        clips = [t for n, t in bundle.tensors.items() if kind_of(n) == kind]
        mean = round(float(torch.stack(clips).double().mean()), 4) if clips else None
        if mean is not None and abs(mean - getattr(bundle.manifest.quant, kind)) > 1e-4:
            out.append(f"manifest quant.{kind} {getattr(bundle.manifest.quant, kind)} is not the mean of the "
                       f"bundle's clips ({mean})")
    return out


def verify_deviations(committed: Path, rebuilt: Bundle) -> tuple[list[Deviation], list[str]]:
    """The rebuilt bundle verified as `oscar verify --record` verified the committed one (same held-out data),
    its headline figures against the recorded ones; ([], []) when nothing was recorded or it ran on CUDA."""
    import json

    from oscar_core.calibrate.data import load_samples
    from oscar_core.calibrate.models import load_model
    from oscar_core.evaluate.verify import VERIFY_FILE, measure_figures, resolve_model_spec

    path = committed / VERIFY_FILE
    if not path.is_file():
        return [], []
    recorded = json.loads(path.read_text())
    if recorded.get("device", "cpu") != "cpu":
        return [], []
    m = rebuilt.manifest
    loaded = load_model(resolve_model_spec(None, m.model, m.calibration.model_source), "cpu")
    ids, fingerprint = load_samples(recorded["data"], loaded.tokenizer, recorded["samples"], recorded["seq_len"],
                                    recorded.get("seed", 0))
    if fingerprint != recorded["data_fingerprint"]:
        return [], [f"{VERIFY_FILE}: the held-out data {recorded['data']} is not what it was recorded on"]
    return figure_deviations(recorded["figures"], measure_figures(loaded, rebuilt, ids), VERIFY_MARGINS), []


def compare(committed: Path, rebuilt: Path, calib_dir: Path,
            run_verify: bool = True) -> tuple[str, list[Deviation], list[str]]:
    """(status, deviations, reasons) of a rebuild against the committed bundle: "same" when byte-identical,
    else "equivalent" or "differs" by the contract of the module doc."""
    from oscar_core.formats.bundle import load_bundle

    diff = differences(committed, rebuilt)
    if not diff:
        return "same", [], []
    if f"{TENSOR_FILE} is not committed" in diff:
        return "differs", [], diff
    try:
        a = load_bundle(committed)
    except OscarError as e:
        return "differs", [], [str(e)]
    b = load_bundle(rebuilt)
    reasons = manifest_differences(a.manifest, b.manifest) + clip_means_problems(a)
    covariances, excesses = rebuild_measures(calib_dir, a, b)
    deviations, structural = tensor_deviations(a.tensors, b.tensors, covariances, excesses)
    reasons += structural
    if run_verify and not reasons and all(d.ok for d in deviations):
        figures, why = verify_deviations(committed, b)
        deviations, reasons = deviations + figures, reasons + why
    reasons += [d.reason() for d in deviations if not d.ok]
    return ("differs" if reasons else "equivalent"), deviations, reasons


def check(zoo_root: str | Path, manifests_root: str | Path,
          on_start: Callable[[Recipe], None] | None = None,
          on_progress: Callable[[int, int, float], None] | None = None, run_verify: bool = True,
          names: list[str] | None = None) -> list[Outcome]:
    """Rebuild every buildable recipe (of `names`, if given) into a temporary zoo and hold it to the committed bundle
    (module doc)."""
    zoo_root, manifests_root = Path(zoo_root), Path(manifests_root)
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="oscar-zoo-check-") as tmp:
        tmp = Path(tmp)
        for recipe in select(load_recipes(zoo_root, required=True), names):
            missing = missing_requirements(recipe)
            if missing:
                outcomes.append(Outcome(recipe, "skipped", skip_reason(missing)))
                continue
            committed = bundle_path(zoo_root, recipe)
            if not committed.is_dir():
                outcomes.append(Outcome(recipe, "missing", f"{committed} is not built: run oscar zoo build"))
                continue
            if on_start:
                on_start(recipe)
            rebuilt = build_one(recipe, tmp / "zoo", tmp / "manifests", tmp / "work", on_progress)
            status, deviations, reasons = compare(committed, rebuilt, calibration_dir(tmp / "work", recipe),
                                                  run_verify)
            copy = manifest_copy_path(manifests_root, recipe.name, recipe.version)
            if not copy.is_file() or copy.read_bytes() != (committed / MANIFEST_FILE).read_bytes():
                status, reasons = "differs", reasons + [f"{copy} is not a copy of the committed manifest"]
            outcomes.append(Outcome(recipe, status, "; ".join(reasons), tuple(deviations)))
    return outcomes
