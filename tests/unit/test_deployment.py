"""The distributed deployment, checked without a Docker engine: compose structure, start order, image tags,
FLEETSCOPE__* variables against the real configuration, CLI commands, Grafana provisioning, and every SQL
query of the dashboard run on chDB (Grafana macros substituted as the ClickHouse plugin does)."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from fleetscope.cli import build_parser
from fleetscope.config import load_config
from fleetscope.producers import SimulatorConfig, parse_fault, simulate
from fleetscope.sinks import ClickHouseWriter, StoreConfig, connect, migrate, run_sql
from fleetscope.streams.offline import OfflinePipeline

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
DASHBOARD = json.loads((ROOT / "deploy/grafana/dashboards/fleetscope.json").read_text())
DATASOURCES = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/clickhouse.yaml").read_text())
FLEETSCOPE_SERVICES = [name for name, s in SERVICES.items() if str(s.get("image", "")).startswith("fleetscope:")]
_INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate(value: object) -> str:
    """Compose's ${VAR:-default} with the variable unset (what a fresh checkout gets)."""
    return _INTERPOLATION.sub(lambda m: m.group(2) or "", str(value))


def depends_on(service: dict[str, Any]) -> dict[str, str]:
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return dict.fromkeys(deps, "service_started")
    return {name: spec.get("condition", "service_started") for name, spec in deps.items()}


def test_the_stack_has_every_component_of_the_design() -> None:
    images = {name: s.get("image", "") for name, s in SERVICES.items()}
    assert images["kafka"].startswith("apache/kafka:")
    assert images["schema-registry"].startswith("confluentinc/cp-schema-registry:")
    assert images["clickhouse"].startswith("clickhouse/clickhouse-server:")
    assert images["grafana"].startswith("grafana/grafana:")
    kafka_env = SERVICES["kafka"]["environment"]
    assert "controller" in kafka_env["KAFKA_PROCESS_ROLES"] and "KAFKA_CONTROLLER_QUORUM_VOTERS" in kafka_env
    commands = {name: SERVICES[name]["command"][0] for name in FLEETSCOPE_SERVICES}
    assert sorted(commands.values()) == ["alerts", "init", "simulate", "sink", "worker"]
    assert SERVICES["worker"]["deploy"]["replicas"] >= 2
    assert "container_name" not in SERVICES["worker"], "a scaled service cannot have a fixed name"
    plugin, _, version = SERVICES["grafana"]["environment"]["GF_INSTALL_PLUGINS"].partition(" ")
    grafana = tuple(int(x) for x in images["grafana"].rpartition(":")[2].split(".")[:2])
    assert plugin == "grafana-clickhouse-datasource" and version, "the plugin is pinned with Grafana"
    # plugin releases 4.15+ need Grafana >= 11.6; 4.0-4.14 support 9.x-11.5
    if grafana < (11, 6):
        assert tuple(int(x) for x in version.split(".")[:2]) <= (4, 14), version


def test_the_dashboard_picks_a_job_and_zooms_to_its_data() -> None:
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    assert "ORDER BY max(start_at) DESC" in variables["job"]["query"]
    assert {"job_from", "job_to"} <= set(variables)
    assert any("from=${job_from}&to=${job_to}" in link["url"] for link in DASHBOARD["links"])
    jobs = next(p for p in DASHBOARD["panels"] if p["title"] == "Jobs")
    assert "from=${__data.fields.from_ms}" in jobs["fieldConfig"]["defaults"]["links"][0]["url"]


def test_no_panel_draws_one_line_per_rank_or_host() -> None:
    for p in DASHBOARD["panels"]:
        if p["type"] == "timeseries":
            sql = p["targets"][0]["rawSql"]
            select = sql[: sql.index("FROM")]
            assert "rank" not in select and not re.search(r"^\s*host,", select, re.M), p["title"]
    assert any(p["type"] == "heatmap" for p in DASHBOARD["panels"])


def test_every_image_has_an_explicit_tag() -> None:
    refs = [s["image"] for s in SERVICES.values()]
    refs += re.findall(r"^FROM\s+(\S+)", (ROOT / "Dockerfile").read_text(), re.M)
    for ref in refs:
        name, _, tag = ref.rpartition(":")
        assert name and "/" not in tag and tag not in ("", "latest"), ref


def test_start_order_waits_for_health_and_has_no_cycle() -> None:
    for name, service in SERVICES.items():
        for dep, condition in depends_on(service).items():
            assert dep in SERVICES, f"{name} depends on unknown service {dep}"
            assert condition in ("service_healthy", "service_completed_successfully"), (name, dep)
            if condition == "service_healthy":
                assert "healthcheck" in SERVICES[dep], f"{name} waits for {dep} to be healthy; it has no check"
            else:
                assert SERVICES[dep].get("restart") == "no", f"{dep} is one-shot; it must not restart"
    for name in ("kafka", "schema-registry", "clickhouse", "worker", "sink", "grafana"):
        assert SERVICES[name]["healthcheck"]["test"], name
    order: list[str] = []
    pending = dict(SERVICES)
    while pending:
        ready = [n for n, s in pending.items() if set(depends_on(s)) <= set(order)]
        assert ready, f"depends_on cycle among {sorted(pending)}"
        order += sorted(ready)
        for n in ready:
            del pending[n]
    assert order.index("init") < order.index("worker") < order.index("simulator")
    assert order.index("kafka") < order.index("schema-registry") < order.index("init")


def test_every_fleetscope_variable_is_a_real_config_key() -> None:
    seen: set[str] = set()
    for name in FLEETSCOPE_SERVICES:
        env = {k: interpolate(v) for k, v in SERVICES[name]["environment"].items()}
        seen |= {k for k in env if k.startswith("FLEETSCOPE__")}
        config = load_config(env=env)  # raises ConfigError naming any unknown key or bad value
        assert config.kafka.bootstrap_servers == "kafka:9092"
        assert config.kafka.registry_url == "http://schema-registry:8081"
        assert config.store.url == "http://clickhouse:8123" and config.store.password
        assert config.metrics_port == 9100
        # several workers in one group (the worker's replicas): docs/scaling.md's first rule
        assert config.streams.job_idle_ms >= 3 * config.kafka.session_timeout_ms
    for service in SERVICES.values():
        stray = [k for k in (service.get("environment") or {}) if k.startswith("FLEETSCOPE_")]
        assert set(stray) <= seen
    assert len(seen) >= 10
    healthcheck = " ".join(SERVICES["worker"]["healthcheck"]["test"])
    assert ":9100/metrics" in healthcheck


def test_the_readme_configuration_is_a_valid_configuration_with_the_defaults_it_shows(tmp_path: Path) -> None:
    """The README's configuration block loads (every key real, in its section: two Kafka keys once stood under
    [producer] there) and shows the defaults the code has, so a user copying it changes nothing by surprise."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    (block,) = re.findall(r"```toml\n(.*?)```", readme, re.DOTALL)
    (tmp_path / "fleetscope.toml").write_text(block)
    shown = load_config(tmp_path / "fleetscope.toml", env={})
    assert shown.streams == load_config(env={}).streams
    assert shown.kafka.sasl_mechanism == "" and shown.producer.heartbeat_interval_ms == 1000


def test_every_fleetscope_command_parses_with_the_real_cli() -> None:
    parser = build_parser()
    for name in FLEETSCOPE_SERVICES:
        args = parser.parse_args(SERVICES[name]["command"])
        assert callable(args.handler), name
    entrypoint = re.search(r"^ENTRYPOINT\s+(.+)$", (ROOT / "Dockerfile").read_text(), re.M)
    assert entrypoint and json.loads(entrypoint.group(1)) == ["fleetscope"]


def test_mounted_files_exist_and_grafana_is_provisioned() -> None:
    for name, service in SERVICES.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"
    (source,) = DATASOURCES["datasources"]
    assert source["type"] == "grafana-clickhouse-datasource"
    assert source["jsonData"]["host"] == "clickhouse" and source["jsonData"]["defaultDatabase"] == "fleetscope"
    uids = {p["datasource"]["uid"] for p in DASHBOARD["panels"]} | {
        t["datasource"]["uid"] for p in DASHBOARD["panels"] for t in p["targets"]
    }
    assert uids == {source["uid"]}
    providers = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/fleetscope.yaml").read_text())
    assert providers["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    assert "./deploy/grafana/dashboards:/var/lib/grafana/dashboards:ro" in SERVICES["grafana"]["volumes"]


# -- the dashboard's SQL on a real ClickHouse engine ------------------------------------------------------

FROM_S, TO_S, INTERVAL_S = int(time.time()) - 6 * 3600, int(time.time()) + 60, 1


def grafana_sql(sql: str, job: str) -> str:
    """Expand the ClickHouse plugin's macros (pkg/macros/macros.go) and the ${job} variable."""
    macros = {
        r"\$__timeFilter_ms\(([^)]+)\)": lambda m: (
            f"{m[1]} >= fromUnixTimestamp64Milli({FROM_S * 1000}) AND {m[1]} <= fromUnixTimestamp64Milli({TO_S * 1000})"
        ),
        r"\$__timeFilter\(([^)]+)\)": lambda m: f"{m[1]} >= toDateTime({FROM_S}) AND {m[1]} <= toDateTime({TO_S})",
        r"\$__timeInterval\(([^)]+)\)": lambda m: (
            f"toStartOfInterval(toDateTime({m[1]}), INTERVAL {INTERVAL_S} second)"
        ),
        r"\$__fromTime\b": lambda m: f"toDateTime({FROM_S})",
        r"\$__toTime\b": lambda m: f"toDateTime({TO_S})",
        r"\$__interval_s\b": lambda m: str(INTERVAL_S),
        r"\$\{job\}|\$job\b": lambda m: job,
    }
    for pattern, repl in macros.items():
        sql = re.sub(pattern, repl, sql)
    assert "$" not in sql, f"unexpanded macro in {sql}"
    return sql


def dashboard_queries() -> list[tuple[str, str]]:
    out = [(p["title"], t["rawSql"]) for p in DASHBOARD["panels"] for t in p["targets"]]
    out += [(f"variable {v['name']}", v["query"]) for v in DASHBOARD["templating"]["list"]]
    return out


@pytest.fixture(scope="module")
def store(chdb_path: Path) -> Iterator[tuple[Any, str]]:
    """A job with a slow GPU on rank 2, one hour ago, written straight into the tables."""
    database = f"dash_{uuid.uuid4().hex[:10]}"
    client = connect(StoreConfig(url=f"chdb://{chdb_path}", database=database))
    migrate(client, database)
    pipeline = OfflinePipeline(keep_patterns=True)
    sim = SimulatorConfig(
        job="dash", ranks=8, iterations=8, start_ns=time.time_ns() - 3600 * 10**9,
        faults=(parse_fault("slow_gpu:2:1.5"),),
    )  # fmt: skip
    result = pipeline.add_all(simulate(sim)).finish()
    writer = ClickHouseWriter(client, database)
    writer.write_iterations(result.iterations)
    writer.write_patterns(pipeline.patterns)
    writer.write_findings(result.finding_updates)
    yield client, database


@pytest.mark.parametrize("title,sql", dashboard_queries(), ids=[t for t, _ in dashboard_queries()])
def test_every_dashboard_query_runs_on_clickhouse(store: tuple[Any, str], title: str, sql: str) -> None:
    client, database = store
    columns, rows = run_sql(client, database, grafana_sql(sql, "dash"), readonly=True)
    assert rows, f"{title}: no rows"
    for table in re.findall(r"\bFROM\s+(\w+)", sql):
        assert table in (
            "iterations",
            "function_patterns",
            "finding_updates",
            "findings",
            "per_rank",
            "per_host",
            "peers",
        )


def test_dashboard_panels_answer_with_the_injected_fault(store: tuple[Any, str]) -> None:
    client, database = store
    panels = {p["title"]: p["targets"][0]["rawSql"] for p in DASHBOARD["panels"]}

    def rows(title: str) -> list[dict[str, Any]]:
        columns, data = run_sql(client, database, grafana_sql(panels[title], "dash"), readonly=True)
        return [dict(zip(columns, r, strict=True)) for r in data]

    assert rows("Open findings")[0]["open_findings"] == 1
    assert rows("Findings")[0]["rank"] == 2
    assert rows("Largest deviations from peers (rank x function)")[0]["rank"] == 2
    slowest = rows("Slowest ranks (top 10 by compute time against the median rank)")
    assert slowest[0]["rank"] == 2 and slowest[0]["gap"] > 0.3 and len(slowest) == 8
    assert all(r["gap"] < 0.05 for r in slowest[1:])
    spread = rows("Compute time across ranks (distribution)")
    assert spread and all(r["max_ms"] > 1.3 * r["median_ms"] for r in spread), "the slow rank is the max line"
    assert rows("Jobs")[0]["job"] == "dash" and rows("Jobs")[0]["from_ms"] < rows("Jobs")[0]["to_ms"]
    assert rows("Findings")[0]["subject"] == "rank:2"
    series = [t for p in DASHBOARD["panels"] if p["type"] == "timeseries" for t in p["targets"]]
    assert series and all(t["format"] == 0 and "AS time" in t["rawSql"] for t in series)
