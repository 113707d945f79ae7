"""Structured-output constraints as sampling parameters (SGLang's names): `json_schema`, `regex`, `ebnf`.

Checked in the user process before anything is queued: at most one per request, and each must parse
(a JSON Schema must also be a valid schema by the `jsonschema` library's own meta-schema check). Where
a request reaches the scheduler only `normalize` runs again: a parse there would block the step loop,
and a constraint that fails to compile fails its request alone. The grammar engine is imported only
when a request carries a constraint.
"""

from __future__ import annotations

import json
from typing import Any

KINDS = ("json_schema", "regex", "ebnf")
TOO_DEEP = "json_schema is nested too deeply to check"


def normalize(params: dict) -> dict[str, str]:
    """{kind: text} for the constraint a sampling dict carries (at most one); ValueError naming the
    field when there are two, or one is not the right type."""
    given = {k: params[k] for k in KINDS if params.get(k) is not None}
    if len(given) > 1:
        raise ValueError(f"give at most one of json_schema, regex and ebnf, got {sorted(given)}")
    if not given:
        return {}
    kind, value = next(iter(given.items()))
    if kind == "json_schema":
        if isinstance(value, dict):
            try:
                value = json.dumps(value)  # its property order is the output order
            except RecursionError:
                raise ValueError(TOO_DEEP) from None
            except (TypeError, ValueError) as exc:  # a set, an object, a circular reference
                raise ValueError(f"json_schema is not JSON: {exc}") from None
        elif not isinstance(value, str):
            raise ValueError(
                f"json_schema must be a JSON Schema as a dict or a string, got {type(value).__name__}"
            )
    elif not isinstance(value, str) or not value:
        raise ValueError(f"{kind} must be a non-empty string, got {value!r}")
    return {kind: value}


def check(kind: str, text: str) -> None:
    """ValueError naming `kind` if the constraint does not parse."""
    if kind == "json_schema":
        try:
            _check_schema(text)
        # a schema nested past json's or jsonschema's depth (a 1 KB body did it)
        except RecursionError:
            raise ValueError(TOO_DEEP) from None
    grammar_of(kind, text)


def _check_schema(text: str) -> None:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"json_schema is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"json_schema must be a JSON object, got {type(schema).__name__}")
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ValueError(f"json_schema is not a valid JSON Schema: {exc.message}") from None


def xgrammar() -> Any:
    """The xgrammar module. It is installed without its dependencies (its triton is for GPUs only), so a
    plain `pip install .` lacks it: a constraint is then refused naming how to get it."""
    try:
        import xgrammar as xgr
    except ImportError as exc:
        raise ValueError(
            f"structured output (json_schema, regex, ebnf) needs xgrammar, which is not installed "
            f"({exc}): pip install --no-deps xgrammar==0.2.8 (make run does)"
        ) from None
    return xgr


def grammar_of(kind: str, text: str) -> Any:
    """The grammar (xgrammar's, tokenizer-independent: cheap) of a constraint; ValueError naming it."""
    xgr = xgrammar()

    build = {
        "json_schema": xgr.Grammar.from_json_schema,
        "regex": xgr.Grammar.from_regex,
        "ebnf": xgr.Grammar.from_ebnf,
    }
    try:
        return build[kind](text)
    except Exception as exc:  # noqa: BLE001 - xgrammar raises several types for a bad input
        raise ValueError(
            f"{kind} could not be parsed: {type(exc).__name__}: {str(exc).strip()[:300]}"
        ) from None
