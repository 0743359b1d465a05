"""`servewise bench ...`: one module per benchmark (HELP, arguments(parser), run(namespace))."""
