"""``python -m ktm.cli ...``: the form launchers take (torchrun, accelerate launch)."""

from ktm.cli.main import program

raise SystemExit(program())
