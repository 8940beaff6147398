"""``python -m healsweep`` runs the command line."""

from healsweep.cli import main

main()
