"""`posttrain models list|load|pull|graft-vision|upcycle`: what models are available locally, how fast they
load, Hub models pre-downloaded into huggingface_hub's cache (models/hub.py), the grafted vision-language
model on the embedded default (models/vision.py) and sparse upcycling (models/upcycle.py)."""

from __future__ import annotations

import time

import typer
from rich.table import Table

from posttrain.cli.common import EXIT_RUNTIME, EXIT_USAGE, console, fail

app = typer.Typer(help="Models available on this machine.", no_args_is_help=True, rich_markup_mode=None)


@app.command("list")
def list_models() -> None:
    """Show the embedded default, the tiny test families and cached model folders."""
    from posttrain.models import list_local

    table = Table("spec", "kind", "location", "cached")
    for info in list_local():
        table.add_row(info.spec, info.kind, info.location, "yes" if info.cached else "no")
    console.print(table)


@app.command("load")
def load(spec: str = typer.Argument("smollm2-135m")) -> None:
    """Load a model (converting and caching the embedded default on first use) and report the time."""
    from posttrain.models import ModelNotFoundError, load_policy, load_tokenizer

    try:
        t0 = time.perf_counter()
        model = load_policy(spec)
        load_tokenizer(spec)
    except ModelNotFoundError as err:
        fail(str(err), EXIT_USAGE)
    n = sum(p.numel() for p in model.parameters())
    console.print(f"{spec}: {n / 1e6:.1f}M parameters loaded in {time.perf_counter() - t0:.2f} s")


@app.command("pull")
def pull(
    repo: str = typer.Argument(..., help="a Hub model id, ORG/NAME (or ORG/NAME@REVISION)"),
    revision: str = typer.Option(None, "--revision", help="a branch, a tag or a commit (default: main)"),
) -> None:
    """Download a Hub model into the Hugging Face cache (HF_HOME / HF_HUB_CACHE), e.g. on a login node, so
    that `model.spec: ORG/NAME` loads from the cache where the Hub cannot be reached (HF_HUB_OFFLINE=1)."""
    from posttrain.models import ModelNotFoundError
    from posttrain.models.hub import HubId, parse_hub_id, pull

    hub_id = parse_hub_id(repo)
    if hub_id is None:
        fail(f"'{repo}' is not a Hub model id: give ORG/NAME or ORG/NAME@REVISION", EXIT_USAGE)
    if revision is not None:
        if hub_id.revision is not None and hub_id.revision != revision:
            fail(f"two revisions: '{repo}' and --revision {revision}; give one", EXIT_USAGE)
        hub_id = HubId(hub_id.repo, revision)
    try:
        folder = pull(hub_id)
    except ModelNotFoundError as err:
        fail(str(err), EXIT_RUNTIME)
    console.print(f"{hub_id}: {folder}")


@app.command("graft-vision")
def graft_vision_cmd(
    out: str = typer.Option(..., "--out", help="folder to write the LLaVA model and its processor to"),
    seed: int = typer.Option(0, help="seed of the from-scratch vision encoder and projector"),
    image_size: int = typer.Option(96, help="input side in pixels"),
    patch_size: int = typer.Option(16, help="patch side in pixels (one image token per patch)"),
    vision_hidden: int = typer.Option(192, help="vision encoder width"),
    vision_layers: int = typer.Option(4, help="vision encoder layers"),
    vision_heads: int = typer.Option(3, help="vision encoder attention heads"),
) -> None:
    """SmolLM2-135M (the embedded default) + a SigLIP-style vision encoder and a projector, both
    initialised from scratch (no vision weights ship here), saved as an HF LLaVA folder."""
    from posttrain.models import ModelNotFoundError
    from posttrain.models.vision import graft_vision, save_vision_folder

    for name, value in (
        ("image-size", image_size),
        ("patch-size", patch_size),
        ("vision-hidden", vision_hidden),
        ("vision-layers", vision_layers),
        ("vision-heads", vision_heads),
    ):
        if value < 1:
            fail(f"--{name} must be >= 1, got {value}", EXIT_USAGE)
    if image_size % patch_size or vision_hidden % vision_heads:
        fail(
            "--image-size must be a multiple of --patch-size and --vision-hidden of --vision-heads, got "
            f"{image_size}/{patch_size} and {vision_hidden}/{vision_heads}",
            EXIT_USAGE,
        )
    try:
        model, tok = graft_vision(
            seed,
            image_size=image_size,
            patch_size=patch_size,
            vision_hidden=vision_hidden,
            vision_layers=vision_layers,
            vision_heads=vision_heads,
        )
    except ModelNotFoundError as err:
        fail(str(err), EXIT_USAGE)
    path = save_vision_folder(model, tok, out)
    vision = sum(p.numel() for p in model.model.vision_tower.parameters())
    proj = sum(p.numel() for p in model.model.multi_modal_projector.parameters())
    console.print(
        f"{path}: SmolLM2-135M + a from-scratch vision encoder ({vision / 1e6:.2f}M) and projector "
        f"({proj / 1e6:.2f}M); {model.config.image_seq_length} image tokens per {image_size}px image"
    )


@app.command("upcycle")
def upcycle_cmd(
    spec: str = typer.Argument("smollm2-135m", help="the dense model to upcycle"),
    out: str = typer.Option(..., "--out", help="folder to write the MoE model and its tokenizer to"),
    experts: int = typer.Option(4, "--experts", help="experts per layer (each a copy of the dense MLP)"),
    top_k: int = typer.Option(2, "--top-k", help="experts each token is routed to"),
    router_std: float = typer.Option(0.02, "--router-std", help="std of the router's seeded normal init"),
    expert_noise: float = typer.Option(
        0.0,
        "--expert-noise",
        help="noise added to each expert copy, relative to the weights' std; > 0 breaks the equality "
        "with the dense model",
    ),
    seed: int = typer.Option(0, help="seed of the router init and the expert noise"),
) -> None:
    """Sparse upcycling: a Mixtral (Llama/Mistral) or Qwen3-MoE (Qwen3) HF folder whose experts copy the
    dense MLP; with --expert-noise 0 its outputs equal the dense model's at initialisation."""
    from posttrain.models import ModelNotFoundError
    from posttrain.models.upcycle import upcycle_to_folder

    try:
        path, moe = upcycle_to_folder(spec, out, experts, top_k, router_std, expert_noise, seed)
    except ModelNotFoundError as err:
        fail(str(err), EXIT_USAGE)
    except ValueError as err:
        fail(str(err), EXIT_USAGE)
    cfg = moe.config
    total = sum(p.numel() for p in moe.parameters())
    per_expert = 3 * cfg.hidden_size * (getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size)
    active = total - (experts - top_k) * per_expert * cfg.num_hidden_layers
    console.print(
        f"{path}: {cfg.model_type}, {experts} experts, top {top_k}; {total / 1e6:.1f}M parameters, "
        f"{active / 1e6:.1f}M active per token"
    )
