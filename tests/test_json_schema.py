"""JSON-schema task: JSON extraction, draft-aware validation, dataset errors, loader."""

import json
from pathlib import Path

import pytest

from daca.tasks import get_task
from daca.tasks.json_schema import extract_json, is_valid, schema_problem

pytest.importorskip("jsonschema")

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
DRAFT4 = "http://json-schema.org/draft-04/schema#"
DRAFT7 = "http://json-schema.org/draft-07/schema#"
DRAFT2020 = "https://json-schema.org/draft/2020-12/schema"


def tagged(answer: str) -> str:
    return f"<reasoning>\nFill in the fields.\nDone.\n</reasoning>\n<answer>\n{answer}\n</answer>\n"


def test_extract_json_from_tags_fences_and_prose():
    assert extract_json(tagged('{"a": 1}')) == {"a": 1}
    fenced = tagged('Here it is:\n```json\n{"a": [1, 2]}\n```\nhope it helps')
    assert extract_json(fenced) == {"a": [1, 2]}
    assert extract_json(tagged('Sure! {"a": {"b": "}"}} and more text')) == {"a": {"b": "}"}}
    assert extract_json(tagged("null")) is None  # null is a JSON value
    assert extract_json('no tags {"x": true}') == {"x": True}
    missing = extract_json(tagged("{'a': 1}"))  # Python, not JSON
    assert not is_valid(missing, {})
    assert not is_valid(extract_json(tagged('{"a": NaN}')), {})  # not strict JSON


def test_json_rewards_by_hand():
    task = get_task("json_schema")
    completions = [
        tagged('{"name": "Ada", "age": 36}'),  # valid
        tagged('```json\n{"name": "Ada", "age": 36}\n```'),  # valid, fenced
        tagged('{"name": "Ada"}'),  # missing required
        tagged('{"name": "Ada", "age": -1}'),  # minimum
        tagged('{"name": "Ada", "age": "36"}'),  # wrong type
        tagged('{"name": "Ada", "age": 36, "x": 1}'),  # additionalProperties
        tagged('{"name": "Ada", "age": 36'),  # invalid JSON
        '{"name": "Ada", "age": 36}',  # valid, no format
    ]
    n = len(completions)
    schemas = [PERSON] * (n - 1) + [json.dumps(PERSON)]  # a JSON string works too
    valid, fmt = [
        f(prompts=[""] * n, completions=completions, schema=schemas, id=[0] * n)
        for f in task.reward_funcs
    ]
    assert valid == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert fmt == [0.5] * (n - 1) + [0.0]
    assert task.score(completions, schema=schemas) == valid
    prompt = task.chat_prompt({"schema": PERSON})
    assert '"required": ["name", "age"]' in prompt and "<answer>" in prompt


def test_validation_follows_the_declared_draft():
    # Draft 4's boolean exclusiveMaximum ...
    d4 = {"$schema": DRAFT4, "type": "number", "maximum": 5, "exclusiveMaximum": True}
    assert is_valid(4, d4) and not is_valid(5, d4)
    # ... is an invalid schema under 2020-12, the default without $schema.
    undeclared = {k: v for k, v in d4.items() if k != "$schema"}
    assert schema_problem(undeclared) is not None
    with pytest.raises(ValueError, match="dataset error"):
        is_valid(4, undeclared)
    # prefixItems exists from 2020-12 on; draft 7 ignores the unknown keyword.
    prefix = {"prefixItems": [{"type": "integer"}]}
    assert not is_valid(["a"], {"$schema": DRAFT2020, **prefix})
    assert is_valid(["a"], {"$schema": DRAFT7, **prefix})
    assert not is_valid(["a"], prefix)


def test_invalid_schemas_are_dataset_errors_not_zeros():
    task = get_task("json_schema")
    for schema in ({"type": "no-such-type"}, {"$ref": "#/definitions/missing"}, "{not json", 3):
        with pytest.raises(ValueError, match="schema"):
            task.score([tagged("{}")], schema=[schema])


def test_loader_drops_invalid_schemas_with_a_warning(tmp_path):
    path = tmp_path / "schemas.jsonl"
    lines = [
        {"id": "a", "schema": PERSON},
        {"id": "b", "schema": {"type": 7}},
        {"id": "c", "schema": json.dumps({"type": "string"})},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    task = get_task("json_schema")
    with pytest.warns(UserWarning, match=r"dropped 1 rows.*\(b\)"):
        rows = task.load(path=path)
    assert [r["id"] for r in rows] == ["a", "c"]
    assert [r["id"] for r in task.load(path=path, drop_invalid=False)] == ["a", "b", "c"]
    path.write_text('{"id": "a", "schema": {}}\n{"id": "b"}\n')
    with pytest.raises(ValueError, match="line 2: missing schema"):
        task.load(path=path)


def test_loader_on_github_medium():
    path = DATA / "jsonschemabench" / "github_medium.jsonl"
    if not path.exists():
        pytest.skip(f"{path} absent (the shared data folder is not mounted)")
    task = get_task("json_schema")
    rows = task.load(path=path, limit=5)
    assert len(rows) == 5 and all(isinstance(r["schema"], dict) for r in rows)
    assert rows[0]["id"] == "o1" and rows[0]["schema"]["required"] == ["corrections"]
    # o1 (draft 4) needs a "corrections" array.
    completions = [tagged('{"corrections": []}'), tagged("{}")]
    assert task.score(completions, schema=[rows[0]["schema"]] * 2) == [1.0, 0.0]
