"""`servewise experiment ...`: one module per source paper's evaluation (HELP, arguments(parser), run(namespace))."""
