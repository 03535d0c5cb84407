"""Zero-code-change path: ``fleetscope run -- torchrun ... train.py`` injects the PyTorch hook.

Why a ``sitecustomize`` bootstrap: every Python process started under ``fleetscope run`` (torchrun's
launcher, its ranks, ``python train.py``) imports ``sitecustomize`` from the directory prepended to
``PYTHONPATH``. The bootstrap imports nothing heavy: it arms a one-shot import hook, and only when the process
itself imports ``torch`` does it load ``fleetscope.producers.torch_hook`` with ``FLEETSCOPE_TORCH_HOOK=auto``
(step boundaries from ``optimizer.step()``). Processes that never step an optimizer (the launcher,
dataloader workers) never start monitoring. A ``sitecustomize`` already on the path is chained, not
shadowed. Not effective under ``python -S``/``-I``, which skip ``sitecustomize``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

ENV_HOOK = "FLEETSCOPE_TORCH_HOOK"

SITECUSTOMIZE = '''"""fleetscope bootstrap (written by `fleetscope run`): arm the PyTorch hook, chain."""
import os as _os
import sys as _sys


def _fleetscope_arm():
    try:
        from fleetscope.producers.torch_bootstrap import arm

        arm()
    except Exception as exc:  # never break the program being launched
        _sys.stderr.write(f"fleetscope: PyTorch hook not armed: {exc!r}\\n")


def _fleetscope_chain():
    here = _os.path.dirname(_os.path.abspath(__file__))
    ours = _sys.modules.pop("sitecustomize", None)
    saved = list(_sys.path)
    try:
        _sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or ".") != here]
        import importlib

        importlib.import_module("sitecustomize")
    except ImportError:
        pass
    finally:
        _sys.path[:] = saved
        if ours is not None:
            _sys.modules["sitecustomize"] = ours


_fleetscope_arm()
_fleetscope_chain()
'''


def write_bootstrap(directory: str | os.PathLike[str]) -> Path:
    """Write the bootstrap ``sitecustomize.py`` into ``directory``; return the directory."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return path


def bootstrap_env(directory: Path, env: dict[str, str]) -> dict[str, str]:
    """``env`` with the bootstrap first on ``PYTHONPATH`` and the hook in automatic mode."""
    out = dict(env)
    rest = out.get("PYTHONPATH", "")
    out["PYTHONPATH"] = str(directory) + (os.pathsep + rest if rest else "")
    out[ENV_HOOK] = "auto"
    return out


def _on_torch_imported() -> None:
    try:
        import fleetscope.producers.torch_hook  # noqa: F401  (installs the patches; auto mode starts it)
    except Exception as exc:
        logger.warning("fleetscope: PyTorch hook not loaded: %r", exc)


class _TorchWatcher(importlib.abc.MetaPathFinder):
    """One-shot finder: lets the real finders load ``torch``, then runs ``_on_torch_imported``."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original(module)
            _on_torch_imported()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def arm() -> None:
    """Load the hook when (and if) this process imports torch; no-op when disabled or already loaded."""
    if os.environ.get(ENV_HOOK, "").lower() in ("0", "off", "false", "no"):
        return
    if "torch" in sys.modules:
        _on_torch_imported()
    elif not any(isinstance(f, _TorchWatcher) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchWatcher())
