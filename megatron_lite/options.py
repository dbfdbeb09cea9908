"""How a config field declares its doc and command-line flag (read by arguments.py)."""
from __future__ import annotations

from dataclasses import field


def arg(default=None, help: str = "", *, factory=None, **cli):
    """A config field with its one-line doc (what `--help` prints) and how the command line sets it
    (arguments.py): `flag` (default: --field-name; None: not a flag), `aliases`, `choices`, `nargs`,
    `store` ("true"/"false" for a switch that sets the field True/False)."""
    meta = dict(help=help, **cli)
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)
