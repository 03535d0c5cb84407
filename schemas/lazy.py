"""Lazy package exports: a package's public names imported from their submodules on first use.

Why: a training rank imports ``fleetscope.producers`` (for the torch hook) and loads the configuration
(which names the store's settings); neither may pull in the simulator, the trace parser or the store's
driver. Each package keeps its own table of name -> submodule and defines ``__getattr__`` with this.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping


def load_export(package: str, exports: Mapping[str, str], name: str) -> object:
    """``package``'s public ``name``, imported from its submodule ``exports[name]`` and kept on the package
    (the next lookup is a plain attribute); AttributeError for a name the table does not hold."""
    module = exports.get(name)
    if module is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{package}.{module}"), name)
    setattr(sys.modules[package], name, value)
    return value
