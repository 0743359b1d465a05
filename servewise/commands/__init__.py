"""The command line's commands that stand above both the server and the cluster (a command's module
may import any layer below it; nothing below imports a command)."""
