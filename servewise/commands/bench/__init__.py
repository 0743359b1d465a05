"""`servewise bench ...`: one module per benchmark (HELP, arguments(parser), run(namespace))."""


def settings(cls, a, **given):
    """A bench's Settings: each field from the flag of the same name, unless `given`."""
    from dataclasses import fields

    return cls(**{f.name: getattr(a, f.name) for f in fields(cls) if f.name not in given}, **given)
