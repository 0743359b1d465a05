"""The command line's commands. Each module is one command: `HELP` (its line in the help), `arguments(parser)`
(its flags) and `run(namespace)`, which turns the flags into the settings of the library call it makes;
`servewise.cli` lists them. A command's module may import any layer below it; nothing below imports a command."""
