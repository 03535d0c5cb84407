"""The ``fleetscope`` subcommands, one module per family; each module's ``register(sub, common)`` adds its
parsers with ``set_defaults(handler=cmd_...)``, and a handler takes ``(args, config)`` and returns the exit
status. A new family is a module here and a line in ``FAMILIES``.
"""

from __future__ import annotations

import argparse

from fleetscope import traces_cli
from fleetscope.commands import alerts, deployment, diff, inspector, live, pipeline, queries

FAMILIES = (pipeline, queries, traces_cli, diff, inspector, live, deployment, alerts)
"""In the order ``fleetscope --help`` lists them."""


def register_all(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    for family in FAMILIES:
        family.register(sub, common)
