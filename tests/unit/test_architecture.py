"""Guard rails of the house: which package may import which, what a training rank loads, one category list.

See docs/architecture.md. These read the source as text (AST), so they hold for code paths no test runs.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping
from enum import Enum
from functools import cache
from pathlib import Path

import pytest

from fleetscope import verdict
from fleetscope.schemas import CATALOG, Category
from fleetscope.schemas.categories import REGISTRY
from fleetscope.schemas.records import EventKind

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"fleetscope": "fleetscope", "producers": "producers", "streams": "streams", "schemas": "schemas",
            "sinks": "sinks"}  # fmt: skip
"""Top-level folder -> the name it is imported under (``fleetscope.<folder>``, the CLI package itself)."""


def _imports(path: Path) -> set[str]:
    """Every module an import statement of ``path`` names, at any depth (lazy imports count too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from fleetscope import telemetry`` imports fleetscope.telemetry: name what is imported
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def _sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def _violations(folder: str, allowed: re.Pattern[str]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in _sources(folder)
        for name in sorted(_imports(path))
        if name.startswith("fleetscope") and not allowed.match(name)
    ]


@pytest.mark.parametrize(
    ("folder", "allowed"),
    [
        ("producers", r"^fleetscope(\.producers|\.schemas|\.telemetry|\.config|\.wiring)?(\.|$)"),
        ("sinks", r"^fleetscope(\.sinks|\.schemas|\.telemetry)?(\.|$)"),
        ("schemas", r"^fleetscope\.schemas(\.|$)"),
        ("streams", r"^fleetscope(\.streams|\.schemas|\.telemetry|\.lifetime)(\.|$)"),
    ],
)
def test_data_flows_one_way_between_packages(folder: str, allowed: str) -> None:
    """producers -> schemas -> streams -> sinks: producers never import streams or sinks, sinks never import
    producers or streams, schemas imports nothing of the project but itself. ``telemetry`` and ``lifetime``
    (children die with their parent) import nothing of the project: any package may use them."""
    assert _violations(folder, re.compile(allowed)) == []


def test_analysis_imports_only_numpy_the_standard_library_and_schemas() -> None:
    """The maths stays pure: no Faust, Kafka or ClickHouse under ``streams/analysis``; its settings
    (``streams/settings.py``, which the configuration loads in every rank) import only the standard library."""
    bad = []
    for path in _sources("streams/analysis"):
        for name in _imports(path):
            top = name.split(".")[0]
            if top in sys.stdlib_module_names or top == "numpy":
                continue
            if re.match(r"^fleetscope\.(schemas|streams\.analysis|streams\.settings)(\.|$)", name):
                continue
            bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert bad == []
    settings = ROOT / "streams" / "settings.py"
    assert {n for n in _imports(settings) if n.split(".")[0] not in sys.stdlib_module_names} == set()
    windower = _imports(ROOT / "streams" / "analysis" / "windowing.py")
    assert not {n for n in windower if n.startswith("fleetscope.streams.analysis.joblevel")}, "differential side"


STORE_INTERNALS = re.compile(
    r"^(clickhouse_connect|chdb|fleetscope\.sinks\.(clickhouse|connect|migrate|ClickHouse\w*|run_sql|"
    r"current_findings|table_counts|readonly_\w+))(\.|$)"
)
"""The ClickHouse driver, chDB and the adapter's internals: what only ``sinks/clickhouse/`` may import."""
ADAPTER = "sinks/clickhouse/"


def test_the_store_seam_holds() -> None:
    """Only the ClickHouse adapter knows ClickHouse: the sink, the alerts, the retry policy and the CLI reach
    the store through ``sinks/store.py`` (``Store``, ``open_store``, ``adapter``), which finds the adapter by
    the URL's scheme in ``store_config.STORE_KINDS`` and imports it by that name: no module imports it."""
    bad = []
    for folder in PACKAGES:
        for path in _sources(folder):
            where = path.relative_to(ROOT).as_posix()
            if where.startswith(ADAPTER):
                continue
            bad += [f"{where} imports {name}" for name in sorted(_imports(path)) if STORE_INTERNALS.match(name)]
    assert bad == []
    sink = _imports(ROOT / "sinks" / "sink.py")
    assert "fleetscope.sinks.store.RecordWriter" in sink, "the sink writes through the seam"


SQL_STATEMENT = re.compile(
    r"^\s*(SELECT|WITH|INSERT|ALTER|CREATE|DELETE|DROP|OPTIMIZE|SYSTEM|KILL|EXPLAIN|TRUNCATE|RENAME|USE)\s"
    r"[\s\S]*?(\b(FROM|INTO|TABLE|DATABASE|VIEW|QUERY|AST|WHERE)\b|\{\w+:[A-Z]\w*)|^\s*USE\s"
)
"""A string that reads as a SQL statement: a statement keyword first, then what it acts on or a server-side
parameter (``{job:String}``), in capitals as SQL is written here (prose that starts with "Select" or says
"delete from" does not match)."""


def _sql_literals(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each string literal (an f-string's constant parts joined) that reads as SQL, except
    the next checks of ``schemas/categories.py`` (``NextChecks(sql=...)``): text handed to people to run
    with ``fleetscope sql``, in the store's own dialect, never sent by the code."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    handed_over: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "NextChecks":
            handed_over.update(id(n) for kw in node.keywords if kw.arg == "sql" for n in ast.walk(kw.value))
    found = []
    for node in ast.walk(tree):
        if id(node) in handed_over:
            continue
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        else:
            continue
        if SQL_STATEMENT.match(text):
            found.append((node.lineno, " ".join(text.split())[:60]))
    return found


def test_no_module_outside_the_store_adapter_builds_sql() -> None:
    """Every read a command makes is a ``Store`` method, so its SQL lives in the adapter: no module of the
    packages outside ``sinks/clickhouse/`` holds a SQL statement (a literal starting with a statement
    keyword and naming what it acts on). ``fleetscope sql`` passes the user's own text through."""
    bad = [
        f"{path.relative_to(ROOT)}:{line}: {text}"
        for folder in PACKAGES
        for path in _sources(folder)
        if not path.relative_to(ROOT).as_posix().startswith(ADAPTER)
        for line, text in _sql_literals(path)
    ]
    assert bad == []
    adapter = ROOT / "sinks" / "clickhouse" / "queries.py"
    assert _sql_literals(adapter), "the rule sees the adapter's own statements"


def test_a_training_rank_loads_neither_the_store_driver_nor_the_stream_engine_nor_the_simulator() -> None:
    """The torch hook runs in every rank: importing it and loading the configuration (as monitoring does at
    start) must not import clickhouse-connect, chDB, Faust, aiokafka, the simulator, the trace parser or any
    of the analysis (``streams.analysis``: the differential's maths runs in the stream workers)."""
    probe = (
        "import sys\n"
        "import fleetscope.producers.torch_hook\n"
        "from fleetscope.config import load_config\n"
        "load_config(env={})\n"
        "heavy = ('clickhouse_connect', 'chdb', 'faust', 'aiokafka', 'pandas', 'fleetscope.producers.simulation',\n"
        "         'fleetscope.producers.kineto', 'fleetscope.sinks.clickhouse', 'fleetscope.streams.app',\n"
        "         'fleetscope.streams.analysis')\n"
        "print(sorted(m for m in sys.modules if m.startswith(heavy)))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_every_place_that_lists_finding_categories_lists_the_same_ones() -> None:
    """``Category`` is the one list; the findings schema's contract, the report's colours, the README's
    table (each line the category's meaning), the detection page (a section each, its properties table) and
    the simulator's expected findings must all name exactly these."""
    want = {c.value for c in Category}
    field = next(f for f in CATALOG.latest("findings").parsed["fields"] if f["name"] == "category")
    assert {c.strip() for c in field["doc"].split("|")} == want

    from fleetscope.svgcharts import CATEGORY_COLORS

    assert set(CATEGORY_COLORS) == want

    from fleetscope.schemas.categories import REGISTRY

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme.split("## How it decides", 1)[1].split("\n## ", 1)[0]
    lines = dict(re.findall(r"^\| `([a-z_]+)` \| (.*) \|$", table, flags=re.MULTILINE))
    assert lines == {c.value: about.meaning for c, about in REGISTRY.items()}, "the README's line is the meaning"

    detection = (ROOT / "docs" / "detection.md").read_text(encoding="utf-8")
    assert set(re.findall(r"^## `([a-z_]+)`$", detection, flags=re.MULTILINE)) == want, "an evidence section each"
    yes = {True: "yes", False: "no"}
    flags = {
        c.value: [yes[a.cause], yes[a.job_level], a.noise.value, yes[a.profiler_blind]] for c, a in REGISTRY.items()
    }
    rows = re.findall(r"^\| `([a-z_]+)` \| (yes|no) \| (yes|no) \| ([a-z_]+) \| (yes|no) \|$", detection, re.M)
    assert {row[0]: list(row[1:]) for row in rows} == flags, "docs/detection.md's properties are the registry's"

    from fleetscope.producers.simulation import CATEGORIES as FAULT_CATEGORIES

    assert set(FAULT_CATEGORIES.values()) <= want


def test_every_category_has_every_property() -> None:
    """``schemas/categories.py`` holds each category's properties: a category added to ``Category`` without
    its meaning, verdict phrase, colour, flags or next checks fails here, not in a person's terminal."""
    from fleetscope.producers.nvml_api import _COUNTERS, DEVICE_METRICS, SLOW_METRICS
    from fleetscope.schemas.categories import REGISTRY, Noise

    sampled = {*DEVICE_METRICS, *SLOW_METRICS, *(metric for metric, _ in _COUNTERS.values()), "xid"}
    assert set(REGISTRY) == set(Category)
    colors = [about.color for about in REGISTRY.values()]
    assert len(set(colors)) == len(colors), "one colour per category"
    fields = {"function": "gemm", "gap": "+52%", "numbers": "2 ms vs 1 ms", "metric": "mean", "value": "2 ms",
              "less_cpu_wait": ""}  # fmt: skip
    for category, about in REGISTRY.items():
        where = category.value
        assert about.category is category, where
        assert re.fullmatch(r"[A-Z][^.]*(\.[^ ][^.]*)*\.", about.meaning), f"{where}: meaning is one sentence"
        assert about.phrase and about.phrase.format(**fields) != about.phrase, f"{where}: a phrase with figures"
        assert re.fullmatch(r"#[0-9a-f]{6}", about.color), where
        assert isinstance(about.cause, bool) and isinstance(about.job_level, bool), where
        assert isinstance(about.profiler_blind, bool) and isinstance(about.noise, Noise), where
        assert not (about.cause and about.job_level), f"{where}: a job-level finding names no rank to wait for"
        checks = about.checks
        assert re.match(r"SELECT\b", checks.sql) and "{job:String}" in checks.sql, where
        assert set(re.findall(r"\{(\w+):", checks.sql)) <= {"job", "ranks", "function"}, where
        assert checks.nvml and set(checks.nvml) <= sampled, f"{where}: NVML fields the agent does not sample"
        assert checks.likely_causes and all(checks.likely_causes), where


def _emitted_categories(path: Path) -> set[str]:
    """The categories a module's code passes as ``category=``: a string or ``Category.X`` (``.value``)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.keyword) or node.arg != "category":
            continue
        value = node.value
        if isinstance(value, ast.Attribute) and value.attr == "value":
            value = value.value
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            out.add(value.value)
        elif isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) and value.value.id == "Category":
            out.add(Category[value.attr].value)
    return out


def test_every_category_has_a_detector_that_can_emit_it() -> None:
    """A category no detector under ``streams/`` emits is a promise the README makes and nothing keeps; one
    emitted that is not a ``Category`` is a name alert consumers were never told about."""
    emitted = set().union(*(_emitted_categories(path) for path in _sources("streams")))
    assert emitted == {c.value for c in Category}


def test_the_findings_schema_file_matches_the_catalog() -> None:
    """The .avsc on disk is what the catalog serves (a hand edit without a new version would drift)."""
    latest = CATALOG.latest("findings")
    on_disk = json.loads((ROOT / "schemas" / "avro" / f"findings.v{latest.version}.avsc").read_text())
    assert [f["name"] for f in on_disk["fields"]] == [f["name"] for f in latest.parsed["fields"]]


def test_the_node_agent_starts_on_a_gpu_node_that_has_no_store_engine() -> None:
    """``fleetscope agent`` runs on every GPU node, where neither the store driver nor the stream engine is
    installed (seen on a real GPU machine: the agent died on a ClickHouse import through the endpoint
    lookup). With those imports (and NVML's) refused, the agent must get as far as saying NVML is missing."""
    probe = (
        "import sys\n"
        "class Refuse:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('clickhouse_connect', 'chdb', 'faust', 'aiokafka', 'pynvml'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}')\n"
        "sys.meta_path.insert(0, Refuse())\n"
        "sys.argv = ['fleetscope', 'agent', '--job', 'j']\n"
        "from fleetscope.cli import main\n"
        "sys.exit(main())\n"
    )
    env = dict(os.environ, FLEETSCOPE__KAFKA__BOOTSTRAP_SERVERS="127.0.0.1:9")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode != 0
    assert "NVML is not available" in out.stderr + out.stdout, out.stderr
    assert "ModuleNotFoundError" not in out.stderr + out.stdout and "clickhouse" not in out.stderr, out.stderr


def test_every_package_folder_is_in_the_distribution() -> None:
    """A package folder missing from pyproject's ``packages`` imports from a checkout but is absent from an
    installed wheel (seen when ``streams/recovery/`` was added)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {"fleetscope": "fleetscope"} | {
        f: f"fleetscope.{f}" for f in ("producers", "streams", "schemas", "sinks")
    }
    found = set()
    for folder, package in folders.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((package, *rel)))
    assert found <= listed, sorted(found - listed)


# The checklists of docs/architecture.md, followed: every place in the code that enumerates the finding
# categories or the raw event kinds is on its list, every file a list names exists, every table keyed by
# them covers all of them, and every category has a verdict sentence.

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


@cache
def _members_named(path: Path, enum: type[Enum]) -> frozenset[str]:
    """The members of ``enum`` a module names: as ``Enum.MEMBER`` or as their value in a string literal."""
    by_value = {str(m.value): m.name for m in enum}
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in by_value:
            found.add(by_value[node.value])
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == enum.__name__:
            if node.attr in enum.__members__:
                found.add(node.attr)
    return frozenset(found)


def _enumerating(enum: type[Enum], files: Iterable[Path]) -> set[str]:
    """Modules that name all members of ``enum`` but one or more: they list them, so a new one belongs there.
    (A detector names its own category and a few it relates to, never nearly all.)"""
    at_least = len(enum) - 1
    return {str(p.relative_to(ROOT)) for p in files if len(_members_named(p, enum)) >= at_least}


def _checklist_sources() -> list[Path]:
    return sorted(p for folder in SOURCES for p in (ROOT / folder).rglob("*.py"))


def _missed(enum: type[Enum], doc: str) -> set[str]:
    return _enumerating(enum, _checklist_sources()) - _named_files(_section(LISTS[enum], doc))


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
