"""derive_key against the vectors every idemgate client shares."""

import json
import pathlib
import re

import pytest

from idemgate_client import derive_key

VECTORS = json.loads(
    (pathlib.Path(__file__).parents[2] / "vectors" / "derive_key.json").read_text("utf-8")
)["vectors"]

UUID_V8 = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-8[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


@pytest.mark.parametrize("vector", VECTORS, ids=lambda v: f"{v['tenant']}/{v['run']}/{v['step']}/{v['tool']}")
def test_the_shared_vectors(vector):
    fields = {k: vector[k] for k in ("tenant", "run", "step", "tool")}
    assert derive_key(**fields) == vector["key"]


def test_the_worked_example_of_the_readme():
    # clients/README.md derives this one with printf and sha256sum.
    assert derive_key(tenant="a", run="bc", step="d", tool="e") == "c8543208-20f7-8152-9c60-7cdc8de31ca4"


def test_a_key_is_a_uuid_v8_so_a_uuid_only_server_takes_it():
    for vector in VECTORS:
        assert UUID_V8.match(vector["key"]), vector["key"]


def test_lengths_keep_fields_apart():
    # Concatenated, ("a", "bc") and ("ab", "c") would be the same bytes.
    assert derive_key(tenant="a", run="bc", step="d", tool="e") != derive_key(
        tenant="ab", run="c", step="d", tool="e"
    )


def test_an_int_step_is_its_decimal_form():
    assert derive_key(tenant="t", run="r", step=7, tool="x") == derive_key(
        tenant="t", run="r", step="7", tool="x"
    )


@pytest.mark.parametrize("field", ["tenant", "run", "step", "tool"])
def test_an_empty_field_is_refused(field):
    fields = {"tenant": "t", "run": "r", "step": "s", "tool": "x", field: ""}
    with pytest.raises(ValueError, match=field):
        derive_key(**fields)


def test_other_types_are_refused():
    with pytest.raises(TypeError):
        derive_key(tenant="t", run="r", step=True, tool="x")
    with pytest.raises(TypeError):
        derive_key(tenant="t", run=3, step="s", tool="x")
