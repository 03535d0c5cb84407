"""A finding's next checks: the query parameters come from the finding, and the printed command is one a
shell splits back into exactly that query and those parameters, whatever the job is called."""

from __future__ import annotations

import shlex

import pytest

from fleetscope.schemas.categories import REGISTRY, check_params, info, next_checks, sql_command


@pytest.mark.parametrize("job", ["demo", "run 7", "$(touch pwned)", "it's", 'say "hi"', "a!b`c`\\d", "ranks=[1]"])
def test_the_printed_command_splits_back_into_the_query_and_its_parameters(job: str) -> None:
    for category in REGISTRY:
        finding = {"job": job, "rank": 5, "ranks": [], "category": category.value, "function": "all reduce"}
        checks = next_checks(finding)["next_checks"]
        argv = shlex.split(sql_command(checks))
        assert argv[:3] == ["fleetscope", "sql", checks["sql"]]
        assert argv[3::2] == ["--param"] * len(checks["params"])
        assert dict(a.split("=", 1) for a in argv[4::2]) == checks["params"]
        assert checks["params"]["job"] == job


def test_the_parameters_are_those_the_query_names() -> None:
    sql = "SELECT 1 FROM iterations WHERE job = {job:String} AND has({ranks:Array(Int32)}, rank)"
    assert check_params({"job": "j", "rank": 3, "ranks": [], "function": "f"}, sql) == {"job": "j", "ranks": "[3]"}
    assert check_params({"job": "j", "rank": -1, "ranks": [2, 9]}, sql)["ranks"] == "[2,9]"
    assert info("no_such_category") is None and next_checks({"category": "no_such_category"}) == {}
