"""The checklists of docs/architecture.md, followed: every place in the code that enumerates the finding
categories or the raw event kinds is on its list, every file a list names exists, every table keyed by them
covers all of them, and every category has a detector, a verdict sentence and its properties."""

from __future__ import annotations

import ast
import importlib
import re
from collections.abc import Iterable, Mapping
from enum import Enum
from pathlib import Path

import pytest

from fleetscope import verdict
from fleetscope.schemas.categories import REGISTRY, Category
from fleetscope.schemas.records import EventKind

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
SOURCES = ("schemas", "streams", "sinks", "producers", "fleetscope", "bench")
LISTS: dict[type[Enum], str] = {Category: "add a finding category", EventKind: "add a raw event kind"}
_NAMED_FILE = re.compile(r"`([\w./-]+\.(?:py|avsc|md))(?:::\w+)?`")


def _section(title: str, text: str) -> str:
    """The checklist under ``## Checklist: <title>``, up to the next heading."""
    start = text.index(f"## Checklist: {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def _named_files(section: str) -> set[str]:
    return set(_NAMED_FILE.findall(section))


def _members_named(path: Path, enum: type[Enum]) -> set[str]:
    """The members of ``enum`` a module names: as ``Enum.MEMBER`` or as their value in a string literal."""
    by_value = {str(m.value): m.name for m in enum}
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in by_value:
            found.add(by_value[node.value])
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == enum.__name__:
            if node.attr in enum.__members__:
                found.add(node.attr)
    return found


def _enumerating(enum: type[Enum], files: Iterable[Path]) -> set[str]:
    """Modules that name all members of ``enum`` but one or more: they list them, so a new one belongs there.
    (A detector names its own category and a few it relates to, never nearly all.)"""
    at_least = len(enum) - 1
    return {str(p.relative_to(ROOT)) for p in files if len(_members_named(p, enum)) >= at_least}


def _sources() -> list[Path]:
    return sorted(p for folder in SOURCES for p in (ROOT / folder).rglob("*.py"))


def _missed(enum: type[Enum], doc: str) -> set[str]:
    return _enumerating(enum, _sources()) - _named_files(_section(LISTS[enum], doc))


@pytest.mark.parametrize("enum", list(LISTS), ids=lambda e: e.__name__)
def test_every_place_that_enumerates_them_is_on_its_checklist(enum: type[Enum]) -> None:
    assert _missed(enum, DOC.read_text()) == set()


@pytest.mark.parametrize("enum", list(LISTS), ids=lambda e: e.__name__)
def test_every_file_a_checklist_names_exists(enum: type[Enum]) -> None:
    named = _named_files(_section(LISTS[enum], DOC.read_text()))
    assert named, "the checklist names its files"
    assert {name for name in named if not (ROOT / name).is_file()} == set()


def test_a_place_left_off_a_checklist_is_found() -> None:
    """The check above can fail: drop a file from the list and it is reported."""
    doc = DOC.read_text()
    for enum, place in ((Category, "producers/simulation/faults.py"), (EventKind, "streams/analysis/windowing.py")):
        assert _missed(enum, doc.replace(f"`{place}`", "the file")) == {place}


def _module(path: str) -> str:
    return "fleetscope." + path.removesuffix(".py").replace("/", ".").removeprefix("fleetscope.")


@pytest.mark.parametrize("enum", list(LISTS), ids=lambda e: e.__name__)
def test_every_table_keyed_by_them_in_a_listed_module_covers_all(enum: type[Enum]) -> None:
    """A module-level mapping keyed by members (``REGISTRY``, ``COLUMNS``, ``TIME_COLUMN``) has every member:
    a new one missing from a table fails here, not at the first event of that kind."""
    named = _named_files(_section(LISTS[enum], DOC.read_text()))
    tables = 0
    for path in sorted(n for n in named if n.endswith(".py") and n.split("/")[0] in SOURCES[:5]):
        module = importlib.import_module(_module(path))
        for name, value in vars(module).items():
            if isinstance(value, Mapping) and value and all(isinstance(k, enum) for k in value):
                tables += 1
                assert set(value.keys()) == set(enum), f"{path}::{name}"
    assert tables >= (1 if enum is Category else 2)


@pytest.mark.parametrize("category", list(Category), ids=str)
def test_every_category_has_a_verdict_sentence(category: Category) -> None:
    finding = {
        "job": "j", "rank": 3, "host": "node000", "category": category.value, "function": "gemm",
        "metric": "mean_ns", "value": 2.0e6, "peer_median": 1.0e6, "est_loss_ns": 4.0e6, "status": "open",
        "iteration_first": 5, "severity": 1.0,
    }  # fmt: skip
    said = verdict.sentence([finding], 1.0e8)
    lead = REGISTRY[category].phrase.split("{")[0].strip()
    assert lead and lead in said and "{" not in said, said
