"""The one converter of the configuration files: TOML's plain data into the schema's classes
(`llmgw.config.schema`) and back, for printing.

It refuses unknown keys and takes nothing loosely: "3" is not an int, a string is not a list, a
table is not a scalar. A problem is reported with its path (`expected int @
$.models[0].replicas`), every one at once, as a `ConfigError`.
"""

from __future__ import annotations

from typing import Any, TypeVar, get_origin

import attrs
import cattrs
from cattrs.cols import homogenous_tuple_structure_factory
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError
from cattrs.gen import make_dict_structure_fn

from llmgw.config import storeurl
from llmgw.config.schema import EngineBuild, Secret, StoreSection
from llmgw.errors import ConfigError

converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
converter.register_structure_hook(Secret, lambda v, _: Secret(_expect_str(v)))
converter.register_unstructure_hook(Secret, lambda s: "<redacted>")


def _expect_str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def _strict(kind: type, name: str):
    # cattrs would turn "3" into 3 and 1.5 into 1; a config file that says "3" is a mistake
    # worth naming, not one to paper over.
    def hook(value: Any, _: type) -> Any:
        ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not ok:
            raise TypeError(f"expected {name}, got {type(value).__name__} {value!r}")
        return value

    return hook


def _is_list_type(t: Any) -> bool:
    return get_origin(t) is tuple and t.__args__[-1] is Ellipsis


def _list_hook(t: Any):
    inner = homogenous_tuple_structure_factory(t, converter)

    def hook(value: Any, _: type) -> Any:
        # Without this a string would be taken as a list of its characters.
        if not isinstance(value, list):
            raise TypeError(f"expected a list, got {type(value).__name__} {value!r}")
        return inner(value, t)

    return hook


def _is_table_type(t: Any) -> bool:
    return attrs.has(t) and t is not Secret


def _table_hook(cl: type):
    inner = make_dict_structure_fn(cl, converter, _cattrs_forbid_extra_keys=True, _cattrs_detailed_validation=True)

    def hook(value: Any, _: type) -> Any:
        if not isinstance(value, dict):
            raise TypeError(f"expected a table, got {type(value).__name__} {value!r}")
        return inner(value, cl)

    return hook


def _build_or_false(value: Any, _: type) -> EngineBuild | None:
    # TOML has no null: `build = false` is how a table says "build nowhere".
    if value is False:
        return None
    if not isinstance(value, dict):
        raise TypeError(f"expected a table (url, sha256, ...) or false, got {type(value).__name__} {value!r}")
    return converter.structure(value, EngineBuild)


def _workers(value: Any, _: type) -> int | str:
    # `[server] gateway_workers`: a whole number of processes (0: none, the gateway in-process) or "auto".
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return value
    raise TypeError(f'expected a whole number of worker processes (0 or more) or "auto", got {value!r}')


def _one_or_several(value: Any, _: type) -> str | tuple[str, ...]:
    # agent.toml's `server`: one control plane's URL, or a list of every one's.
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise TypeError(f"expected a string or a list of strings, got {type(value).__name__} {value!r}")


def _store_printed(store: StoreSection) -> dict:
    # Printed and logged with its hosts, ports and database name only (`storeurl.redact`).
    return {
        "url": storeurl.redact(store.url),
        "password_file": store.password_file,
        "lease_ttl_s": store.lease_ttl_s,
        "lease_renew_s": store.lease_renew_s,
    }


converter.register_structure_hook(int | str | None, _workers)
converter.register_structure_hook(str | tuple[str, ...], _one_or_several)
converter.register_unstructure_hook(StoreSection, _store_printed)
converter.register_structure_hook(EngineBuild | None, _build_or_false)
converter.register_unstructure_hook(EngineBuild | None, lambda b: False if b is None else converter.unstructure(b))
converter.register_structure_hook_factory(_is_list_type, _list_hook)
converter.register_structure_hook_factory(_is_table_type, _table_hook)
converter.register_structure_hook(int, _strict(int, "int"))
converter.register_structure_hook(float, _strict(float, "a number"))
converter.register_structure_hook(str, _strict(str, "a string"))
converter.register_structure_hook(bool, _strict(bool, "true or false"))


def _format_error(exc: BaseException, type_: Any) -> str:
    if isinstance(exc, ForbiddenExtraKeysError):
        allowed = sorted(f.name.lstrip("_") for f in attrs.fields(exc.cl))
        keys = ", ".join(repr(k) for k in sorted(exc.extra_fields))
        return f"unknown key {keys} (allowed here: {', '.join(allowed)})"
    if isinstance(exc, KeyError):
        return "required key is missing"
    if isinstance(exc, TypeError) and str(exc).startswith("expected"):
        return str(exc)
    return f"invalid value: {exc}"


T = TypeVar("T")


def structure(data: dict, cls: type[T], path: str) -> T:
    """`data` as a `cls`, or a `ConfigError` naming `path` (the file) and every problem in it."""
    try:
        return converter.structure(data, cls)
    except (ClassValidationError, IterableValidationError) as exc:
        raise ConfigError(path, cattrs.transform_error(exc, path="$", format_exception=_format_error)) from None


def to_dict(cfg: Any) -> dict:
    """The config as plain data, secrets redacted: safe to print and to log."""
    return converter.unstructure(cfg)
