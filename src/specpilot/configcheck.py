"""The workflow's config, checked before any rule is built: values from ``--config`` parsed to the
types the schema asks for, derived defaults filled in, and one short message per mistake.

Snakemake parses ``--config key=value`` itself: a top-level scalar becomes an int, float or bool
where it looks like one, but a nested value such as ``--config 'rounds={count: 1, budget: 2}'`` is
read with YAML's base loader, so every leaf arrives as a string (``{"count": "1"}``), and dotted
keys (``rounds.count=1``) are refused by Snakemake. :func:`coerce` turns such strings into the type
the schema expects at that place (``"1"`` -> 1, ``"true"`` -> True, ``"[1, 2]"`` -> [1, 2]); a string
that does not parse to a valid value is left as it is, for the schema check to name.

Validation uses ``jsonschema`` (Draft 2020-12, the schema's dialect) and reports the first error as
one line naming the key path, e.g. ``config: unknown key 'n_promts' (did you mean 'n_prompts'?)``,
instead of Snakemake's ``validate`` message, which prints the whole schema.
"""

from __future__ import annotations

import copy
import difflib
from pathlib import Path
from typing import Any

import yaml

from .errors import SpecpilotError
from .regimes import resolve as resolve_regimes


def load_schema(path: str | Path) -> dict:
    """The schema as a dict (YAML or JSON file)."""
    try:
        return yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise SpecpilotError(f"config schema not found: {path}") from None


def _resolve(schema: dict, root: dict) -> dict:
    """Follow a local ``$ref`` (``#/$defs/name``)."""
    while isinstance(schema, dict) and "$ref" in schema:
        ref = schema["$ref"]
        if not ref.startswith("#/"):
            return schema
        node: Any = root
        for part in ref[2:].split("/"):
            node = node[part]
        schema = node
    return schema


def _types(schema: dict, root: dict) -> set[str]:
    """JSON types a (sub)schema allows, looking through anyOf/oneOf and const/enum."""
    schema = _resolve(schema, root)
    if not isinstance(schema, dict):
        return set()
    out: set[str] = set()
    t = schema.get("type")
    if isinstance(t, str):
        out.add(t)
    elif isinstance(t, list):
        out.update(t)
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key, []):
            out |= _types(sub, root)
    for v in ([schema["const"]] if "const" in schema else []) + list(schema.get("enum", [])):
        out.add({bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null"}
                .get(type(v), "object"))
    return out


def _valid(value: Any, schema: dict, root: dict) -> bool:
    import jsonschema

    return jsonschema.Draft202012Validator({**schema, "$defs": root.get("$defs", {})}).is_valid(value)


def _container_schema(schema: dict, root: dict, kind: str) -> dict | None:
    """The (sub)schema describing an object or array at this place (first matching alternative)."""
    schema = _resolve(schema, root)
    if not isinstance(schema, dict):
        return None
    if schema.get("type") == kind or (isinstance(schema.get("type"), list) and kind in schema["type"]):
        return schema
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key, []):
            found = _container_schema(sub, root, kind)
            if found is not None:
                return found
    if kind == "object" and ("properties" in schema or "additionalProperties" in schema):
        return schema
    return None


def coerce(value: Any, schema: dict, root: dict | None = None) -> Any:
    """``value`` with strings parsed where the schema wants another type (see the module docstring).

    Args:
        value: a config value (dict, list or scalar), e.g. the whole config.
        schema: the schema at this place; ``root`` the whole schema (for ``$ref``), default ``schema``.

    Returns:
        A new value; the input is not modified.
    """
    root = schema if root is None else root
    sub = _resolve(schema, root)
    if isinstance(value, str):
        allowed = _types(sub, root)
        if allowed and "string" not in allowed or (allowed and not _valid(value, sub, root)):
            try:
                parsed = yaml.safe_load(value)
            except yaml.YAMLError:
                return value
            if not isinstance(parsed, str) and _valid(parsed, sub, root):
                return coerce(parsed, sub, root) if isinstance(parsed, (dict, list)) else parsed
        return value
    if isinstance(value, dict):
        obj = _container_schema(sub, root, "object") or {}
        props = obj.get("properties", {})
        extra = obj.get("additionalProperties")
        out = {}
        for k, v in value.items():
            s = props.get(k, extra if isinstance(extra, dict) else None)
            out[k] = coerce(v, s, root) if isinstance(s, dict) else v
        return out
    if isinstance(value, list):
        arr = _container_schema(sub, root, "array") or {}
        items = arr.get("items")
        return [coerce(v, items, root) for v in value] if isinstance(items, dict) else list(value)
    return value


def _path(parts) -> str:
    return ".".join(str(p) for p in parts)


def _message(error, schema: dict) -> str:
    """One line for a jsonschema error: the key path and what is wrong, no schema dump."""
    where = _path(error.absolute_path)
    prefix = f"config {where}" if where else "config"
    if error.validator == "additionalProperties":
        known = list((error.schema or {}).get("properties", {}))
        extra = sorted(set(error.instance) - set(known)) if isinstance(error.instance, dict) else []
        parts = []
        for key in extra:
            close = difflib.get_close_matches(str(key), known, n=1)
            parts.append(f"unknown key {key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        if parts:
            keys = ", ".join(known)
            return f"{prefix}: {'; '.join(parts)}; valid keys here: {keys}"
    if error.validator == "required":
        return f"{prefix}: {error.message}"
    value = repr(error.instance)
    value = value if len(value) <= 80 else value[:77] + "..."
    text = error.message if len(error.message) <= 200 else error.message[:197] + "..."
    if error.validator in ("oneOf", "anyOf"):
        desc = (error.schema or {}).get("description")
        text = f"{value} is not an allowed value" + (f" ({desc})" if desc else "")
    return f"{prefix}: {text}"


def check_config(config: dict, schema_path: str | Path) -> dict:
    """Parse, check and complete the workflow config in place; returns it.

    Steps: :func:`coerce` every value to the schema's types; validate against the schema (first
    error, one line); fill derived defaults: ``rounds.max_new_tokens`` null/absent = the top-level
    ``max_new_tokens`` (at least 2, a calibration request needs a verify step), ``stop_at_eos``
    false, ``regimes`` resolved (:func:`specpilot.regimes.resolve`: the derived ``single`` regime
    first, each regime checked).

    Raises:
        SpecpilotError: the config does not match the schema (the key path and the problem named).
    """
    import jsonschema

    schema = load_schema(schema_path)
    fixed = coerce(copy.deepcopy(dict(config)), schema)
    if isinstance(fixed.get("cell_requests"), dict):  # YAML reads `1: 6` with an integer key
        fixed["cell_requests"] = {str(k): v for k, v in fixed["cell_requests"].items()}
    config.clear()
    config.update(fixed)
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(config), key=lambda e: len(e.absolute_path))
    if errors:
        # the shallowest error first: a top-level typo is named before anything below it
        raise SpecpilotError(_message(errors[0], schema))
    rounds = config.setdefault("rounds", {})
    if rounds.get("max_new_tokens") is None:
        rounds["max_new_tokens"] = max(2, int(config["max_new_tokens"]))
    config.setdefault("stop_at_eos", False)
    config["regimes"] = resolve_regimes(config)  # single (derived or given) first, then the others
    return config
