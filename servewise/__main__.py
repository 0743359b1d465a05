"""`python -m servewise`: the same command line as `servewise`."""
from servewise.cli import main

main()
