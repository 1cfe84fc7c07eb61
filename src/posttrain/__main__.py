"""`python -m posttrain` runs the CLI."""

from posttrain.cli import main

main()
