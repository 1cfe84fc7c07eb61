"""Subcommands whose capability has not landed yet: they say so and exit non-zero, never pretend."""

from __future__ import annotations

import typer

from posttrain.cli.common import not_yet_available


def serve(ctx: typer.Context) -> None:
    """Serve a model behind an OpenAI-compatible API (not yet available)."""
    not_yet_available("`posttrain serve`", "the serving issue")
