"""`python -m kvstore`: the kvstore command."""

from kvstore.cli import main

main()
