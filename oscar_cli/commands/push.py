"""oscar push: publish a verified bundle with its model card to the Hugging Face Hub or ModelScope."""

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from oscar_cli.ui import console
from oscar_core.publish import hub as hub_core

HELP = "Verify a bundle and publish it, with a generated model card, to the Hugging Face Hub or ModelScope."
EXAMPLES = """Examples:

  oscar push zoo/Qwen/Qwen3-8B/v1 --hub hf --repo my-org/Qwen3-8B-oscar --dry-run

  HF_TOKEN=... oscar push zoo/Qwen/Qwen3-8B/v1 --hub hf --repo my-org/Qwen3-8B-oscar

  oscar push zoo/Qwen/Qwen3-8B/v1 --hub modelscope --repo my-org/Qwen3-8B-oscar --token-env MS_TOKEN

  oscar push rotationzoo/Qwen3-8B/seq1048576_prompt256_group128 --layout upstream --hub hf --repo my-org/Qwen3-8B-oscar-sglang
"""


class Layout(str, Enum):
    oscar = "oscar"
    upstream = "upstream"


class Hub(str, Enum):
    hf = "hf"
    modelscope = "modelscope"


def push(
    bundle: Annotated[Path, typer.Argument(help="Bundle directory (rotations.safetensors + manifest.json), or with --layout upstream a directory written by `oscar upstream export`.")],
    hub: Annotated[Hub, typer.Option(help="Where to publish.")],
    repo: Annotated[str, typer.Option(help="Target repository, ORG/NAME.")],
    revision: Annotated[Optional[str], typer.Option(help="Branch to commit to; default: the hub's main branch.")] = None,
    private: Annotated[bool, typer.Option("--private", help="Create the repo private (an existing repo keeps its visibility).")] = False,
    token_env: Annotated[Optional[str], typer.Option(metavar="VAR", help="Read the token from $VAR instead of the client's usual places.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would be uploaded, then stop; touches nothing.")] = False,
    layout: Annotated[Layout, typer.Option(help="oscar: the bundle; upstream: a directory from `oscar upstream export` (the SGLang files).")] = Layout.oscar,
) -> None:
    """Verify BUNDLE, write its model card, and publish both to --repo in one commit."""
    plan = hub_core.plan_push(str(bundle), hub.value, repo, revision, private, layout.value)
    if dry_run:
        render_plan(plan, token_env)
        return
    result = hub_core.push(plan, token_env)
    m = plan.manifest
    if result.status == "unchanged":
        console.print(f"unchanged: {repo} on {hub_core.HUB_NAMES[hub.value]} already holds {m.name} {m.version} "
                      f"(nothing uploaded): {result.url}", highlight=False, soft_wrap=True)
    else:
        created = " (new repo)" if result.created_repo else ""
        console.print(f"published {m.name} {m.version} to {repo}{created} on {hub_core.HUB_NAMES[hub.value]}: "
                      f"{result.url}", highlight=False, soft_wrap=True)


def render_plan(plan: hub_core.Plan, token_env: str | None) -> None:
    where = f"{plan.repo}@{plan.revision}" if plan.revision else plan.repo
    console.print(f"dry run: would push {plan.manifest.name} {plan.manifest.version} to {where} on "
                  f"{hub_core.HUB_NAMES[plan.hub]} ({'private' if plan.private else 'public'} if created), "
                  f"token from {hub_core.token_source(plan.hub, token_env)}; nothing was sent",
                  highlight=False, soft_wrap=True)
    width = max(len(f.path) for f in plan.files)
    for f in plan.files:
        console.print(f"  {f.path:<{width}}  {f.size:>12,} bytes  sha256 {f.sha256}", highlight=False, soft_wrap=True)
    console.rule(hub_core.CARD_FILE)
    console.print(plan.card, markup=False, highlight=False, soft_wrap=True, end="")
    console.rule()


def register(app: typer.Typer) -> None:
    app.command("push", help=HELP, epilog=EXAMPLES)(push)
