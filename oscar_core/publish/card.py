"""Model cards: the README.md a hub shows for a bundle, written from its manifest alone.

Every manifest string reaches the card through text() or code(), so whatever a model id or data source holds
(a newline, `---`, `<script>`, `|`) is shown as text on its line and never read as markdown, HTML or YAML.
"""

import json
import re
from pathlib import PurePosixPath

from oscar_core.formats.bundle import MANIFEST_FILE, Manifest

LICENSE = {"hf": "apache-2.0", "modelscope": "Apache License 2.0"}
TAGS = ("kv-cache", "int2", "oscar", "quantization", "rotation")
PIPELINE_TAG = "text-generation"   # the task of the model the bundle serves
# The hub's relations are adapter, merge, quantized and finetune. A bundle holds no weights: it is loaded beside the
# base model's own and changes how that model runs (its KV cache), as an adapter is; "quantized" would list it among
# quantized copies of the weights.
BASE_MODEL_RELATION = "adapter"
DOWNLOAD = {"hf": "hf download {repo} --local-dir {dir}", "modelscope": "modelscope download {repo} --local-dir {dir}"}
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
CONTROL = re.compile(r"[\x00-\x1f\x7f]+")


def text(value) -> str:
    """A manifest value as literal markdown text on one line: control characters become a space; HTML and the
    characters that make links, code or emphasis are escaped (a table cell's `|` by _table)."""
    value = CONTROL.sub(" ", str(value)).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return re.sub(r"([\\`*\[\]])", r"\\\1", value)


def code(value) -> str:
    """A manifest value as an inline code span on one line, fenced by more backticks than it holds."""
    value = CONTROL.sub(" ", str(value))
    fence = "`" * (max(map(len, re.findall("`+", value)), default=0) + 1)
    pad = " " if value.startswith("`") or value.endswith("`") else ""
    return f"{fence}{pad}{value}{pad}{fence}"


def export_served(manifest: Manifest, eigenvalues: bool | None = None) -> tuple[Manifest, str, list[str]]:
    """serve_section's arguments for a bundle in our layout: what `oscar upstream export` writes from it by default
    (per layer, --clips upstream: 0.96 / 0.92, group min(128, head_dim)), and the command that writes it, with
    --calibration unless the bundle carries its eigenvalues and keeps every layer's keys per token."""
    per_channel = any(e.key_axis == "channel" for e in manifest.quant.layers or ())
    carried = manifest.source is not None if eigenvalues is None else eigenvalues
    export = "oscar upstream export oscar-bundle --out rotations --clips upstream" + (
        "" if carried and not per_channel else " --calibration CALIBRATION_DIR")
    group = min(128, manifest.model.head_dim)
    served = manifest.model_copy(update={"quant": manifest.quant.model_copy(update={
        "key_group_size": group, "key_clip": 0.96, "value_clip": 0.92}), "source": None})
    name = export_directory(manifest, group)
    return served, f"rotations/{name}", [f"{export}   # writes rotations/{name}/ and serve.sh"]


def export_directory(manifest: Manifest, group: int) -> str:
    from oscar_core.publish.upstream import directory_name, model_directory

    c = manifest.calibration
    return f"{model_directory(manifest.model.id)}/{directory_name(c.tokens, c.samples, group)}"


def base_model(manifest: Manifest) -> str | None:
    """The model's hub id, or None when the bundle was built from a directory or a .gguf file."""
    model_id = manifest.model.id
    return model_id if HUB_ID.fullmatch(model_id) and not model_id.endswith(".gguf") else None


def front_matter(manifest: Manifest, hub: str) -> str:
    """YAML metadata in the hub's convention (JSON scalars are valid YAML, and quote safely)."""
    base = base_model(manifest)
    if hub == "hf":
        fields = {"license": LICENSE[hub], "library_name": "oscar", "base_model": base,
                  "base_model_relation": BASE_MODEL_RELATION if base else None, "pipeline_tag": PIPELINE_TAG,
                  "tags": list(TAGS)}
    else:
        fields = {"license": LICENSE[hub], "tasks": ["text-generation"], "frameworks": ["pytorch"],
                  "base_model": [base] if base else None, "tags": list(TAGS)}
    lines = ["---"]
    for key, value in fields.items():
        if value is None:
            continue
        if isinstance(value, list):
            lines.append(f"{key}:")
            lines.extend(f"- {json.dumps(item)}" for item in value)
        else:
            lines.append(f"{key}: {json.dumps(value)}")
    return "\n".join(lines + ["---"]) + "\n"


def _key_formats(q) -> list[str]:
    """A paragraph and table on the layers whose keys are not per token (manifest quant.layers), if any."""
    channel = [e for e in q.layers or () if e.key_axis == "channel"]
    if not channel:
        return []
    lines = [f"Keys of {len(channel)} of {len(q.layers)} layers are quantized per channel instead, over blocks of "
             f"{q.key_group_size} tokens (KIVI-style, in the rotation named below): the export measured, on the "
             "calibration probe, the relative attention-output error of each candidate key format and kept the "
             "smallest. Keys and values of those layers leave the BF16 window a block at a time.", ""]
    names = sorted({n for e in q.layers for n in e.errors})
    rows = [(str(e.layer), text(e.key_format), *(f"{e.errors[n]:.4f}" if n in e.errors else "" for n in names))
            for e in q.layers]
    return lines + _table(rows, ("layer", "kept", *map(text, names))) + [""]


def _table(rows: list[tuple[str, ...]], header: tuple[str, ...] = ("", "")) -> list[str]:
    def cells(row) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |"

    return [cells(header), "|" + "---|" * len(header)] + [cells(row) for row in rows]


def _number(x: float) -> str:
    return f"{x:.4g}"


def serve_section(manifest: Manifest, files_dir: str, how_to_get: list[str]) -> list[str]:
    """"Serve with SGLang": the environment and command of the method authors' runtime for rotation files in
    files_dir (upstream layout; per layer unless the manifest's source says per head), after the steps in
    how_to_get."""
    from oscar_core.publish.upstream import FORMAT_VERSIONS, serve_command, serve_env, shell_lines

    q = manifest.quant
    clips = {"key": q.key_clip, "value": q.value_clip}
    per_head = manifest.source is not None and manifest.source.grouping == "head"
    env = serve_env(PurePosixPath(files_dir), clips, q.sink_tokens, q.recent_tokens, absorb=not per_head)
    loader = ([f"These files hold one rotation per KV head (format version {FORMAT_VERSIONS['head']}): only an SGLang",
               "tree whose loader takes `[num_kv_heads, d, d]` rotations reads them, not the authors' own loader."]
              if per_head else [])
    return ["", "## Serve with SGLang", "",
            "The method authors' SGLang tree serves an INT2 KV cache with these rotations (their format: two `.pt`",
            "files, one clip ratio per side, keys not centred).", *loader, "", "```bash", *how_to_get,
            shell_lines(env, serve_command(manifest.model.id, q.key_group_size)).rstrip(), "```"]


def vllm_section(manifest: Manifest) -> list[str]:
    """"Serve with vLLM": empty until oscar's vLLM backend ships (issue 53): its command goes here, and only a
    command that works."""
    return []


def model_card(manifest: Manifest, hub: str, repo: str, upstream_files: dict[str, str] | None = None,
               eigenvalues: bool | None = None) -> str:
    """The README.md for `repo` on `hub` ('hf' or 'modelscope'): what the bundle is, how it was made, how to use it.

    upstream_files (repo path -> sha256): the repo holds the upstream layout (manifest: as `oscar upstream import`
    reads those files), not the bundle. eigenvalues: whether the bundle carries those of C_Q and C_S (then its
    upstream export needs no calibration directory); None: an imported bundle does."""
    if hub not in LICENSE:
        raise ValueError(f"unknown hub {hub!r}")
    m, q, r, c = manifest.model, manifest.quant, manifest.rotation, manifest.calibration
    lines = [front_matter(manifest, hub), f"# OSCAR rotations for {text(m.id)} ({text(manifest.version)})", "",
             f"An OSCAR rotation bundle for {code(m.id)}: per layer and KV head, the orthogonal rotations and clip",
             "ratios that let the model keep its KV cache in 2-bit integers (INT2). It holds no model weights:",
             "load the model from its own repository and apply these rotations to its keys and values.", "",
             "## Model", ""]
    model_rows = [("model", code(m.id))]
    if m.revision:
        model_rows.append(("revision", code(m.revision)))
    if m.file_sha256:
        model_rows.append(("weights file sha256", code(m.file_sha256)))
    model_rows += [("architecture", text(m.architecture)), ("layers", str(m.num_layers)),
                   ("attention heads / KV heads", f"{m.num_heads} / {m.num_kv_heads}"),
                   ("head dim", str(m.head_dim)), ("config sha256", code(m.config_sha256))]
    lines += _table(model_rows)

    centred = [name for name, on in (("keys", r.key_centering), ("values", r.value_centering)) if on]
    lines += ["", "## Quantization", "",
              f"INT{q.bits}, per token and asymmetric, in groups of {q.key_group_size} channels for keys and "
              f"{q.value_group_size} for values (scale format `{q.scale_format}`). The first {q.sink_tokens} "
              f"tokens and the most recent {q.recent_tokens} stay in BF16. Keys are stored as k·R_K with "
              f"R_K = {code(r.key)}, values as v·R_V with R_V = {code(r.value)}"
              + (f"; {' and '.join(centred)} are centred on their calibration mean first." if centred else ".")
              + f" Clip ratios ({q.clip_scope}): keys {_number(q.key_clip)}, values {_number(q.value_clip)} "
              f"on average, chosen for {text(q.clip_objective)}.", ""] + _key_formats(q)
    bits = sorted(q.bits_per_element.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0)
    lines += _table([(f"{int(k):,}" if k.isdigit() else k, f"{v:.3f}") for k, v in bits],
                    ("context (tokens)", "bits per K/V element, all metadata counted"))

    lines += ["", "## Calibration", ""]
    lines += _table([("data", text(c.data)), ("data fingerprint", code(c.data_fingerprint)),
                     ("samples × sequence length", f"{c.samples} × {c.seq_len} ({c.tokens:,} tokens)"),
                     ("seed", str(c.seed))])

    lines += ["", "## Fidelity", ""]
    if manifest.fidelity:
        lines += _table([(text(key), _number(value)) for key, value in sorted(manifest.fidelity.items())],
                        ("measure", "value"))
        lines.append("")
    else:
        lines += ["No verify or eval figures were recorded for this bundle.", ""]
    bound = (f"the model's next-token KL against BF16 passes {manifest.max_kl} nats or "
             if manifest.max_kl is not None else "")
    lines.append(f"`oscar verify` fails this bundle when, with its INT2 cache, {bound}the model's next-token KL, "
                 "perplexity, NLL excess over "
                 "BF16 in any position bucket or needle retrieval is worse than with a KIVI-style INT2 cache, at the "
                 "length it is served (32,768 tokens on CUDA by default; `verified at tokens` above).")

    if upstream_files:
        first = next(iter(upstream_files))
        files_dir = first.rsplit("/", 1)[0]
        lines += ["", "## Files", ""]
        lines += _table([(code(path), f"sha256 {code(sha)}") for path, sha in upstream_files.items()], ("file", "sha256"))
        if manifest.source and manifest.source.notes:
            lines += ["", "Not carried by this format: " + "; ".join(map(text, manifest.source.notes)) + "."]
        lines += serve_section(manifest, f"rotations/{files_dir}",
                               [DOWNLOAD[hub].format(repo=repo, dir="rotations"), f"# or: sh rotations/{files_dir}/serve.sh"])
        lines += vllm_section(manifest)
        lines += ["", "Check them with oscar: `oscar upstream import rotations/" + files_dir + " --out imported`, then",
                  "`oscar verify imported/...` (its INT2 attention error on held-out text).", "",
                  f"Built with {text(manifest.tool.name)} {text(manifest.tool.version)}."]
        return "\n".join(lines) + "\n"

    lines += ["", "## Files", ""]
    lines += _table([(text(manifest.tensors.file), f"{manifest.tensors.bytes:,} bytes, sha256 {code(manifest.tensors.sha256)}"),
                     (MANIFEST_FILE, "model, quantization, rotations, calibration and the checksum above")],
                    ("file", "content"))

    lines += ["", "## Usage", "", "```bash", DOWNLOAD[hub].format(repo=repo, dir="oscar-bundle"), "```", "",
              "```python", "from oscar_core.formats.bundle import load_bundle",
              "",
              'bundle = load_bundle("oscar-bundle")        # checks the manifest and the checksum',
              'r_k = bundle.layer(0, "key_rotation")       # [kv_heads, head_dim, head_dim]',
              "```", "",
              "R_K is orthogonal, so q·k = (q·R_K)·(k·R_K): the read path rotates each query once and attends to",
              "the stored keys as they are. R_V can be folded into the value and output projections:",
              "`oscar_core.serve.absorb.absorb_value_rotation(model, bundle)`, then",
              "`OscarCache(bundle, values_absorbed=True)`."]
    lines += serve_section(*export_served(manifest, eigenvalues))
    lines += vllm_section(manifest)
    lines += ["", "The export writes one rotation per layer (C_Q and C_S averaged over the KV heads), the only shape",
              "every known loader reads, and prints what the format drops (key centring, per-head clips, keys per",
              "channel). Before writing, it measures the served variant with `oscar verify`'s figures beside the",
              "bundle's and refuses one that loses to KIVI-style INT2 (`--force` writes it anyway). Without",
              "`--clips upstream` it searches one clip per side on the calibration data instead of the runtime's",
              "defaults; `--per-head` keeps the bundle's per-head rotations for loaders that take them.",
              "", f"Built with {text(manifest.tool.name)} {text(manifest.tool.version)}."]
    return "\n".join(lines) + "\n"
