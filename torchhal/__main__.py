"""`python -m torchhal` runs the `torchhal` command."""

from torchhal.cli import main

main()
