"""mkdocs hooks of the docs site: add the generated reference pages (scripts/docs_reference.py) to the
build, so the CLI and config references are rebuilt from the code every time and never stored."""

from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.structure.files import File, Files

sys.path.insert(0, str(Path(__file__).resolve().parent))

import docs_reference  # noqa: E402 - found beside this file


def on_files(files: Files, config) -> Files:
    for rel, make in docs_reference.PAGES.items():
        files.append(File.generated(config, rel, content=make()))
    return files
