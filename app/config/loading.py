"""Build the config from Serve args: an optional `config` YAML path, then dotted `key=value` pairs.

    serve run app:graph config=my.yaml prefill.replicas=2 limits.retry_after_s=3

Later sources win: the defaults, the YAML file, then each arg. YAML values keep their YAML type
and are checked as they are (`replicas: 1.5` is refused). A string arg is parsed by the type of
its key first, as Serve's CLI gives only strings: a string key takes it as it is; a boolean key
takes true/false (also yes/no, 1/0); a list key takes `a,b` or a YAML list (empty: none); any other
key takes it as a YAML value (`2`, `1.5`, `{efa: 1}`), a number key also `1e9`. A dotted key may
also name one entry of a mapping key (`prefill.bundle_resources.efa=1`). Then every value is
checked strictly, and one ValueError lists every problem by its dotted key.
"""

import copy
import dataclasses
import enum
import typing
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError

from app.config.app_config import AppConfig

BOOLEANS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


def load_config(args: Mapping[str, Any] | None = None) -> AppConfig:
    args = copy.deepcopy(dict(args or {}))  # merging writes into the mappings it is given
    values: dict[str, Any] = _read_yaml(Path(args.pop("config"))) if "config" in args else {}
    for key, value in args.items():
        path = key.split(".")
        _merge(values, path, parse_arg(path, value) if isinstance(value, str) else value)
    try:
        return _adapter().validate_python(values)
    except ValidationError as exc:
        raise ValueError("invalid config: " + "; ".join(describe(error) for error in exc.errors())) from None


@cache
def _adapter() -> TypeAdapter:
    return TypeAdapter(AppConfig)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        values = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"invalid config: config={path}: {exc}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(f"invalid config: config={path} must hold a mapping of keys, not {type(values).__name__}")
    return values


def _merge(values: dict[str, Any], path: list[str], value: Any) -> None:
    """Set `path` in `values`; a mapping given for a section merges key by key into what is there."""
    tree = values
    for key in path[:-1]:
        if not isinstance(tree.get(key), dict):
            tree[key] = {}
        tree = tree[key]
    if isinstance(value, Mapping) and _is_section(key_type(path)):
        if not isinstance(tree.get(path[-1]), dict):
            tree[path[-1]] = {}
        for key, item in value.items():
            _merge(values, [*path, key], item)
    else:
        tree[path[-1]] = value


def parse_arg(path: list[str], text: str) -> Any:
    """A Serve CLI string as the value its key's type expects; left as it is where it does not parse
    (the check then names the key and the text)."""
    kind = _base(key_type(path))
    if kind is str or (isinstance(kind, type) and issubclass(kind, enum.Enum)):
        return text
    if kind is bool:
        return BOOLEANS.get(text.strip().lower(), text)
    if typing.get_origin(kind) is tuple and not text.lstrip().startswith("["):
        return tuple(item.strip() for item in text.split(",") if item.strip())
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if kind is float and isinstance(value, str):
        try:
            return float(text)
        except ValueError:
            return text
    return value


def key_type(path: list[str]) -> Any:
    """The declared type of a dotted key (an entry of a mapping key has the mapping's value type),
    or None for a key no section has."""
    kind: Any = AppConfig
    for key in path:
        if typing.get_origin(_base(kind)) is Mapping:
            kind = typing.get_args(_base(kind))[1]
        elif _is_section(kind) and key in {f.name for f in dataclasses.fields(kind)}:
            kind = typing.get_type_hints(kind, include_extras=True)[key]
        else:
            return None
    return kind


def _is_section(kind: Any) -> bool:
    return isinstance(kind, type) and dataclasses.is_dataclass(kind)


def _base(kind: Any) -> Any:
    while typing.get_origin(kind) is typing.Annotated:
        kind = typing.get_args(kind)[0]
    return kind


PHRASES = {
    "int_type": "must be an integer", "int_parsing": "must be an integer", "int_from_float": "must be an integer",
    "float_type": "must be a number", "float_parsing": "must be a number",
    "bool_type": "must be true or false", "bool_parsing": "must be true or false",
    "string_type": "must be a string", "tuple_type": "must be a list", "list_type": "must be a list",
    "dataclass_type": "must be a mapping of keys", "dict_type": "must be a mapping",
    "mapping_type": "must be a mapping", "enum": "must be one of {expected}",
    "greater_than": "must be > {gt}", "greater_than_equal": "must be >= {ge}",
    "less_than": "must be < {lt}", "less_than_equal": "must be <= {le}",
    "too_short": "must have at least {min_length} item(s)",
}


def describe(error: Mapping[str, Any]) -> str:
    """One pydantic error as `dotted.key must ..., got <value>`."""
    path = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"]).lstrip(".")
    kind = error["type"]
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        return f"unknown config key {path}"
    if kind == "value_error":
        message = str(error["ctx"]["error"])
        return f"{path}: {message}" if path else message
    if kind in PHRASES:
        got = repr(error["input"])
        got = got if len(got) <= 60 else got[:57] + "..."
        return f"{path} {PHRASES[kind].format(**error.get('ctx', {}))}, got {got}"
    return f"{path}: {error['msg']}"
