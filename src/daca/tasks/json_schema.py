"""JSON-schema adherence (JSONSchemaBench, Github_medium): write a JSON value the schema accepts.

Rows ``{"id", "schema"}``; ``schema`` is a dict or a JSON string. The completion's JSON is taken
from its answer span (``common.answer_span``): the last fenced block (```json or untagged) that
parses, else the whole span, else the first ``{...}`` or ``[...]`` that parses. JSON is strict
(NaN and Infinity are rejected). Validation uses ``jsonschema`` with the draft the schema declares
in ``$schema`` (4, 6, 7, 2019-09, 2020-12); without ``$schema``, draft 2020-12. ``format`` keywords
are annotations only (jsonschema's default): not asserted.

The schemas' ``pattern`` and ``patternProperties`` regexes run on RE2 (``google-re2``, linear time,
closer to ECMA-262 than Python's ``re``: ``\\d`` and ``\\w`` are ASCII, ``$`` is the end of the
text) when it is installed and compiles them: Python's ``re`` backtracks exponentially on patterns
such as ``^(?:[A-Za-z0-9]+[-]?)+[A-Za-z0-9]$`` (Github_medium o10310) and holds the GIL meanwhile.
Patterns RE2 cannot compile (lookaround, backreferences) use ``re``; the reward guard
(``daca.tasks.rewards``) stops those. A completion that breaks the JSON parser or the validator
(nesting deeper than the recursion limit, ...) is simply not valid JSON: it scores 0.

A schema that is itself invalid, or whose ``$ref`` cannot be resolved, is an error of the dataset:
``score`` and the reward raise ValueError instead of scoring 0. ``load`` drops such rows by
default, with a warning (1 of the 1976 Github_medium schemas fails ``check_schema``).
Rewards: 1.0 when the JSON is valid under the schema + 0.5 soft reasoning/answer format.
"""

from __future__ import annotations

import functools
import json
import re
import warnings
from typing import Any

from daca.tasks import Task
from daca.tasks.common import answer_span, chat_user_message
from daca.tasks.formats import (
    completion_texts,
    fenced_blocks,
    hub_rows,
    read_records,
    soft_format_reward,
)
from daca.tasks.rewards import OUTPUT_ERRORS

VALID_REWARD = 1.0
INSTRUCTION = (
    "Write a JSON value that satisfies the following JSON schema. Put only the JSON inside the "
    "answer tags."
)
_NO_JSON = object()  # sentinel: no JSON found (null is a JSON value)
_OPEN_RE = re.compile(r"[{\[]")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


# What a completion can make the JSON parser or the validator raise (deep nesting: RecursionError).
_PARSER_LIMITS = OUTPUT_ERRORS
_BAD_OUTPUT = (ValueError, *_PARSER_LIMITS)


def _loads(text: str) -> Any:
    """Strict ``json.loads`` (no NaN / Infinity); _NO_JSON when ``text`` is not one JSON value."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except _BAD_OUTPUT:
        return _NO_JSON


def _first_embedded(span: str) -> Any:
    """The first ``{...}`` or ``[...]`` in ``span`` that parses, trying openings from the left
    while the characters scanned stay within a few times the span (an unclosed ``[1,1,...``
    would otherwise be rescanned from every bracket: quadratic)."""
    decoder = json.JSONDecoder(parse_constant=_reject_constant)
    budget = 4 * len(span) + 10_000
    for match in _OPEN_RE.finditer(span):
        start = match.start()
        try:
            return decoder.raw_decode(span, start)[0]
        except json.JSONDecodeError as e:
            budget -= e.pos - start + 1
        except _BAD_OUTPUT:
            budget -= len(span) - start
        if budget < 0:
            break
    return _NO_JSON


def extract_json(text: str) -> Any:
    """The JSON value of a completion (see the module docstring), or ``_NO_JSON``."""
    span = answer_span(text)
    for block in reversed(fenced_blocks(span, ("json",))):
        value = _loads(block)
        if value is not _NO_JSON:
            return value
    value = _loads(span)
    return value if value is not _NO_JSON else _first_embedded(span)


@functools.lru_cache(maxsize=4096)
def _searcher(pattern: str):
    """``search`` of ``pattern``: RE2's when it is installed and compiles it, else ``re``'s.
    Raises ``re.error`` when Python cannot compile it (a dataset error, as before)."""
    python = re.compile(pattern)
    try:
        import re2
    except ImportError:
        return python.search
    options = re2.Options()
    options.log_errors = False  # a pattern RE2 rejects falls back to re: not an error
    options.never_capture = True
    try:
        return re2.compile(pattern, options).search
    except re2.error:
        return python.search


def _pattern(validator, pattern, instance, schema):
    if validator.is_type(instance, "string") and not _searcher(pattern)(instance):
        from jsonschema import ValidationError

        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator, patterns, instance, schema):
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            if _searcher(pattern)(key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


@functools.cache
def _with_linear_patterns(cls):
    """jsonschema's validator class ``cls`` with ``pattern`` and ``patternProperties`` on
    ``_searcher`` (jsonschema calls ``re.search`` and has no hook for another engine)."""
    import jsonschema

    keywords = {"pattern": _pattern, "patternProperties": _pattern_properties}
    return jsonschema.validators.extend(cls, keywords)


def _schema_key(schema: Any) -> str:
    """The schema as JSON text (the validator cache key)."""
    if isinstance(schema, str):
        return schema
    return json.dumps(schema, sort_keys=True)


@functools.lru_cache(maxsize=4096)  # check_schema costs milliseconds; groups share a schema
def _validator(key: str):
    import jsonschema

    try:
        schema = json.loads(key)
    except ValueError:
        raise ValueError(f"a JSON schema string must be JSON, got {key[:200]!r}") from None
    if not isinstance(schema, dict | bool):
        raise ValueError(f"a JSON schema must be an object or a boolean, got {key[:200]!r}")
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        raise ValueError(f"invalid JSON schema (dataset error): {e.message[:300]}") from None
    return _with_linear_patterns(cls)(schema)


def schema_problem(schema: Any) -> str | None:
    """Why ``schema`` is not a usable JSON schema, or None when it is."""
    try:
        _validator(_schema_key(schema))
    except ValueError as e:
        return str(e)
    return None


def is_valid(value: Any, schema: Any) -> bool:
    """Whether the JSON ``value`` satisfies ``schema`` (a dict or JSON string); ``_NO_JSON`` is
    never valid. Raises ValueError for an invalid schema or an unresolvable ``$ref``."""
    validator = _validator(_schema_key(schema))
    if value is _NO_JSON:
        return False
    from referencing.exceptions import Unresolvable  # installed with jsonschema

    try:
        return validator.is_valid(value)
    except _PARSER_LIMITS:  # e.g. nested deeper than the validator's recursion can go
        return False
    except re.error as e:
        raise ValueError(f"JSON schema has an invalid regex (dataset error): {e}") from None
    except Unresolvable as e:
        raise ValueError(f"JSON schema has an unresolvable $ref (dataset error): {e}") from None


def schema_valid_reward(prompts, completions, schema, **columns) -> list[float]:
    """1.0 when the completion's JSON satisfies the schema, else 0."""
    texts = completion_texts(completions)
    return [VALID_REWARD * is_valid(extract_json(t), s) for t, s in zip(texts, schema, strict=True)]


def score(completions, schema, **columns) -> list[float]:
    """1.0 when the completion's JSON satisfies the schema, else 0.0."""
    return [float(v) for v in schema_valid_reward(None, completions, schema)]


def chat_prompt(row: dict[str, Any]) -> str:
    schema = row["schema"] if isinstance(row["schema"], str) else json.dumps(row["schema"])
    return chat_user_message(f"{INSTRUCTION}\n\n```json\n{schema}\n```")


def load(
    split: str = "test",
    path=None,
    limit: int | None = None,
    seed: int = 0,
    drop_invalid: bool = True,
) -> list[dict[str, Any]]:
    """Rows ``{"id", "schema"}`` from a JSONL file (all rows: ``split`` is not used), else
    ``epfl-dlab/JSONSchemaBench`` config Github_medium, ``split``. ``limit`` takes the first
    rows (``seed`` is unused). ``drop_invalid`` drops rows whose schema is unusable (warning)."""
    if path is not None:
        rows = read_records(path, ("schema",))
    else:
        rows = hub_rows("epfl-dlab/JSONSchemaBench", "Github_medium", split)
    if drop_invalid:
        kept, dropped = [], []
        for row in rows:
            if limit is not None and len(kept) == limit:
                break
            (dropped if schema_problem(row["schema"]) else kept).append(row)
        if dropped:
            ids = ", ".join(str(r.get("id", "?")) for r in dropped[:5])
            message = f"dropped {len(dropped)} rows with an invalid JSON schema ({ids})"
            warnings.warn(message, stacklevel=2)
        rows = kept
    return rows if limit is None else rows[:limit]


def make_task() -> Task:
    return Task(
        name="json_schema",
        load=load,
        chat_prompt=chat_prompt,
        reward_funcs=[schema_valid_reward, soft_format_reward],
        score=score,
        columns=("schema",),
    )
