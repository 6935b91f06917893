"""Model cards: the README.md a hub shows for a bundle, written from its manifest alone."""

import json
import re

from oscar_core.bundle import MANIFEST_FILE, Manifest

LICENSE = {"hf": "apache-2.0", "modelscope": "Apache License 2.0"}
TAGS = ("kv-cache", "int2", "oscar", "quantization", "rotation")
DOWNLOAD = {"hf": "hf download {repo} --local-dir {dir}", "modelscope": "modelscope download {repo} --local-dir {dir}"}
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def base_model(manifest: Manifest) -> str | None:
    """The model's hub id, or None when the bundle was built from a directory or a .gguf file."""
    model_id = manifest.model.id
    return model_id if HUB_ID.match(model_id) and not model_id.endswith(".gguf") else None


def front_matter(manifest: Manifest, hub: str) -> str:
    """YAML metadata in the hub's convention (JSON scalars are valid YAML, and quote safely)."""
    base = base_model(manifest)
    if hub == "hf":
        fields = {"license": LICENSE[hub], "library_name": "oscar", "base_model": base, "tags": list(TAGS)}
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


def _table(rows: list[tuple[str, str]], header: tuple[str, str] = ("", "")) -> list[str]:
    out = [f"| {header[0]} | {header[1]} |", "|---|---|"]
    return out + [f"| {key} | {value} |" for key, value in rows]


def _number(x: float) -> str:
    return f"{x:.4g}"


def model_card(manifest: Manifest, hub: str, repo: str) -> str:
    """The README.md for `repo` on `hub` ('hf' or 'modelscope'): what the bundle is, how it was made, how to use it."""
    if hub not in LICENSE:
        raise ValueError(f"unknown hub {hub!r}")
    m, q, r, c = manifest.model, manifest.quant, manifest.rotation, manifest.calibration
    lines = [front_matter(manifest, hub), f"# OSCAR rotations for {m.id} ({manifest.version})", "",
             f"An OSCAR rotation bundle for `{m.id}`: per layer and KV head, the orthogonal rotations and clip",
             "ratios that let the model keep its KV cache in 2-bit integers (INT2). It holds no model weights:",
             "load the model from its own repository and apply these rotations to its keys and values.", "",
             "## Model", ""]
    model_rows = [("model", f"`{m.id}`")]
    if m.revision:
        model_rows.append(("revision", f"`{m.revision}`"))
    if m.file_sha256:
        model_rows.append(("weights file sha256", f"`{m.file_sha256}`"))
    model_rows += [("architecture", m.architecture), ("layers", str(m.num_layers)),
                   ("attention heads / KV heads", f"{m.num_heads} / {m.num_kv_heads}"),
                   ("head dim", str(m.head_dim)), ("config sha256", f"`{m.config_sha256}`")]
    lines += _table(model_rows)

    centred = [name for name, on in (("keys", r.key_centering), ("values", r.value_centering)) if on]
    lines += ["", "## Quantization", "",
              f"INT{q.bits}, per token and asymmetric, in groups of {q.key_group_size} channels for keys and "
              f"{q.value_group_size} for values (scale format `{q.scale_format}`). The first {q.sink_tokens} "
              f"tokens and the most recent {q.recent_tokens} stay in BF16. Keys are stored as k·R_K with "
              f"R_K = `{r.key}`, values as v·R_V with R_V = `{r.value}`"
              + (f"; {' and '.join(centred)} are centred on their calibration mean first." if centred else ".")
              + f" Clip ratios ({q.clip_scope}): keys {_number(q.key_clip)}, values {_number(q.value_clip)} "
              f"on average, chosen for {q.clip_objective}.", ""]
    bits = sorted(q.bits_per_element.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0)
    lines += _table([(f"{int(k):,}" if k.isdigit() else k, f"{v:.3f}") for k, v in bits],
                    ("context (tokens)", "bits per K/V element, all metadata counted"))

    lines += ["", "## Calibration", ""]
    lines += _table([("data", c.data), ("data fingerprint", f"`{c.data_fingerprint}`"),
                     ("samples × sequence length", f"{c.samples} × {c.seq_len} ({c.tokens:,} tokens)"),
                     ("seed", str(c.seed))])

    lines += ["", "## Fidelity", ""]
    if manifest.fidelity:
        lines += _table([(key, _number(value)) for key, value in sorted(manifest.fidelity.items())],
                        ("measure", "value"))
        lines.append("")
    else:
        lines += ["No verify or eval figures were recorded for this bundle.", ""]
    lines.append(f"`oscar verify` fails this bundle when its attention-logit error passes {manifest.max_logit_error}.")

    lines += ["", "## Files", ""]
    lines += _table([(manifest.tensors.file, f"{manifest.tensors.bytes:,} bytes, sha256 `{manifest.tensors.sha256}`"),
                     (MANIFEST_FILE, "model, quantization, rotations, calibration and the checksum above")],
                    ("file", "content"))

    lines += ["", "## Usage", "", "```bash", DOWNLOAD[hub].format(repo=repo, dir="oscar-bundle"), "```", "",
              "```python", "from oscar_core.bundle import load_bundle",
              "",
              'bundle = load_bundle("oscar-bundle")        # checks the manifest and the checksum',
              'r_k = bundle.layer(0, "key_rotation")       # [kv_heads, head_dim, head_dim]',
              "```", "",
              "R_K is orthogonal, so q·k = (q·R_K)·(k·R_K): the read path rotates each query once and attends to",
              "the stored keys as they are. R_V can be folded into the value and output projections.", "",
              f"Built with {manifest.tool.name} {manifest.tool.version}."]
    return "\n".join(lines) + "\n"
