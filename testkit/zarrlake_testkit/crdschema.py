"""What kube-apiserver does with a custom resource's structural schema on every write.

Three steps, in kube-apiserver's order: unknown fields are pruned and defaults filled in
(:func:`apply_schema`); the result is validated against the OpenAPI v3 schema — types,
``required``, ``enum``, ``pattern``, bounds, the formats Kubernetes knows, ``nullable``,
``x-kubernetes-int-or-string``, list-map and list-set uniqueness (:func:`schema_errors`); and,
when none of those errors blocks them, the CEL rules of ``x-kubernetes-validations`` are
evaluated (:func:`rule_errors`), transition rules (those that use ``oldSelf``) only on an update
and only where an old value correlates with the new one. :func:`validate` does the last two and
applies validation ratcheting: on an update, an error about a value that did not change is
forgiven, as with the ``CRDValidationRatcheting`` feature (on by default since 1.30).

Errors are :class:`FieldError`, worded the way Go's ``field.Error`` prints them for Kubernetes
1.32 (``spec.storage.bucket: Invalid value: "X": spec.storage.bucket in body should match
'^...$'``), so a test sees what a cluster refuses and why.

CEL is Google's C++ implementation (PyPI ``cel-expr-python``, with the strings, bindings and
optional extensions that Kubernetes enables too); this module is the glue: it compiles rules
against dynamically typed ``self`` and ``oldSelf``, turns values into CEL values the way the
schema types them, correlates old values and words the results. Not emulated: the
Kubernetes-specific CEL libraries (lists, regex ``find``, URL, IP/CIDR, quantity, format, authz,
semver), cost budgets, ``optionalOldSelf`` (refused when a CRD declares it), and type checking
of rules against the schema (a rule with a type error fails when evaluated, where a cluster
refuses the CRD). Patterns use Python's ``re``, which agrees with Go's RE2 on the patterns
CRDs use; formats are checked for the common subset listed in :data:`FORMATS`.
"""

from __future__ import annotations

import base64
import binascii
import copy
import datetime
import functools
import ipaddress
import json
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from cel_expr_python import cel
from cel_expr_python.ext import ext_bindings, ext_optional, ext_strings

JSON = dict[str, Any]
Location = tuple[str | int, ...]
"""Keys and list indexes from the object's root to a value."""


class _Omitted:
    def __repr__(self) -> str:
        return "OMITTED"


OMITTED: Any = _Omitted()
"""The bad value of a field error that shows none (Go's ``field.OmitValueType``)."""

# Go's field.ErrorType: the cause type in a Status, and how ErrorBody() names it.
TITLES = {
    "FieldValueRequired": "Required value",
    "FieldValueNotSupported": "Unsupported value",
    "FieldValueInvalid": "Invalid value",
    "FieldValueTypeInvalid": "Invalid value",
    "FieldValueTooLong": "Too long",
    "FieldValueTooMany": "Too many",
    "FieldValueDuplicate": "Duplicate value",
    "FieldValueForbidden": "Forbidden",
}
_NO_VALUE = {"FieldValueRequired", "FieldValueForbidden", "FieldValueTooLong"}
# Schema errors after which kube-apiserver does not evaluate the CEL rules (hasBlockingErr).
_BLOCKING = {
    "FieldValueNotSupported",
    "FieldValueRequired",
    "FieldValueTooLong",
    "FieldValueTooMany",
    "FieldValueTypeInvalid",
}
RULES_NOT_CHECKED = (
    "some validation rules were not checked because the object was invalid; correct the "
    "existing errors to complete validation"
)


# --------------------------------------------------------------------------------------------
# Errors, worded as Go's field.Error
# --------------------------------------------------------------------------------------------


def go_string(text: str) -> str:
    """Go's ``%q`` of a string (close enough: JSON's escapes for control characters)."""
    return json.dumps(text, ensure_ascii=False)


def go_number(value: float) -> str:
    """Go's ``%v`` of a number: integral floats without a fraction, as Go prints float64."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e21:
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


def go_syntax(value: Any) -> str:
    """Go's ``%#v`` of a decoded JSON value (a map or slice in a Duplicate error)."""
    if isinstance(value, dict):
        items = ", ".join(f"{go_string(k)}:{go_syntax(v)}" for k, v in sorted(value.items()))
        return f"map[string]interface {{}}{{{items}}}"
    if isinstance(value, list):
        return f"[]interface {{}}{{{', '.join(go_syntax(v) for v in value)}}}"
    if value is None:
        return "interface {}(nil)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return go_number(value)
    return go_string(str(value))


def go_value(value: Any) -> str:
    """How ``field.Error`` prints a bad value: strings quoted, numbers and booleans bare."""
    if value is None:
        return '"null"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return go_number(value)
    if isinstance(value, str):
        return go_string(value)
    return go_syntax(value)


@dataclass(frozen=True)
class FieldError:
    """One cause of a refusal, as Go's ``field.Error``: a type, a field path, the bad value
    (or :data:`OMITTED`) and a detail. ``at`` locates the value whose schema node refused it
    and ``ratchets`` says whether an unchanged value there excuses it (see :func:`validate`)."""

    type: str
    field: str
    value: Any = OMITTED
    detail: str = ""
    at: Location = ()
    ratchets: bool = True

    @property
    def body(self) -> str:
        """The message without the field (``ErrorBody()``; a Status cause's ``message``)."""
        text = TITLES[self.type]
        if self.type not in _NO_VALUE and self.value is not OMITTED:
            text += f": {go_value(self.value)}"
        return f"{text}: {self.detail}" if self.detail else text

    def __str__(self) -> str:
        return f"{self.field}: {self.body}"

    def cause(self) -> JSON:
        """The error as one of a Status's ``details.causes``."""
        return {"reason": self.type, "message": self.body, "field": self.field}


def aggregate(errors: list[FieldError]) -> str:
    """Go's ``utilerrors.NewAggregate(...).Error()``: one message, or ``[a, b]`` (deduplicated)."""
    messages = list(dict.fromkeys(str(e) for e in errors))
    return messages[0] if len(messages) == 1 else f"[{', '.join(messages)}]"


# --------------------------------------------------------------------------------------------
# Pruning and defaulting
# --------------------------------------------------------------------------------------------

_OBJECT_META_KEYS = ("apiVersion", "kind", "metadata")


def apply_schema(
    value: Any, schema: Any, *, root: bool = False, unknown: list[str] | None = None, at: str = ""
) -> Any:
    """Prune unknown fields and fill in defaults, as kube-apiserver does for custom resources.

    Unknown fields of an object are dropped unless its schema has
    ``x-kubernetes-preserve-unknown-fields: true`` (maps use ``additionalProperties``); their
    paths (``spec.bukcet``) are appended to ``unknown`` if given, for ``fieldValidation``.
    ``null`` for a non-nullable field is dropped; a missing field with a ``default`` gets it (and
    the default is pruned and defaulted in turn). Nothing is validated here: see :func:`validate`.
    """
    if not isinstance(schema, dict):
        return value
    if isinstance(value, list):
        items = schema.get("items")
        if not isinstance(items, dict):
            return value
        return [
            apply_schema(v, items, unknown=unknown, at=f"{at}[{i}]") for i, v in enumerate(value)
        ]
    if not isinstance(value, dict) or schema.get("x-kubernetes-int-or-string"):
        return value
    props = schema.get("properties") or {}
    extra = schema.get("additionalProperties")
    keep_unknown = schema.get("x-kubernetes-preserve-unknown-fields") is True or extra is True
    embedded = root or schema.get("x-kubernetes-embedded-resource") is True
    out: JSON = {}
    for key, item in value.items():
        sub = props.get(key)
        where = f"{at}.{key}" if at else key
        if embedded and key in _OBJECT_META_KEYS:
            out[key] = item
        elif isinstance(sub, dict):
            if item is None and not sub.get("nullable"):
                continue
            out[key] = apply_schema(item, sub, unknown=unknown, at=where)
        elif isinstance(extra, dict):
            out[key] = apply_schema(item, extra, unknown=unknown, at=where)
        elif keep_unknown:
            out[key] = item
        elif unknown is not None:
            unknown.append(where)
    for key, sub in props.items():
        if key not in out and isinstance(sub, dict) and "default" in sub:
            out[key] = apply_schema(copy.deepcopy(sub["default"]), sub)
    return out


# --------------------------------------------------------------------------------------------
# OpenAPI v3 validation
# --------------------------------------------------------------------------------------------


def _json_type(value: Any) -> str:
    """The OpenAPI type name of a decoded JSON value, as kube-openapi names it in errors."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _has_type(value: Any, wanted: str) -> bool:
    actual = _json_type(value)
    if wanted == "integer":  # kube-openapi accepts 3.0 for an integer, as JSON does
        return actual == "integer" or (actual == "number" and float(value).is_integer())
    if wanted == "number":
        return actual in ("integer", "number")
    return actual == wanted


def _same(value: Any, option: Any) -> bool:
    """JSON equality: ``true`` is not ``1``, but ``1`` is ``1.0``."""
    if _has_type(value, "number") and _has_type(option, "number"):
        return bool(value == option)
    return _json_type(value) == _json_type(option) and value == option


def _is_date_time(text: str) -> bool:
    if not re.fullmatch(
        r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})", text
    ):
        return False
    try:
        datetime.datetime.fromisoformat(text.upper().replace("Z", "+00:00"))
    except ValueError:
        return False
    return True


def _is_date(text: str) -> bool:
    try:
        datetime.date.fromisoformat(text)
    except ValueError:
        return False
    return bool(re.fullmatch(r"\d{4}-\d{2}-\d{2}", text))


def _is_ip(text: str, version: int) -> bool:
    try:
        return ipaddress.ip_address(text).version == version
    except ValueError:
        return False


def _is_cidr(text: str) -> bool:
    try:
        ipaddress.ip_network(text, strict=False)
    except ValueError:
        return False
    return "/" in text


_UUID = re.compile(r"(?i)[0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12}")


def _is_uuid(text: str, version: int | None = None) -> bool:
    if not _UUID.fullmatch(text):
        return False
    return version is None or uuid.UUID(text).version == version


def _is_base64(text: str) -> bool:
    try:
        base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


_HOSTNAME = re.compile(
    r"(?i)^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*\.?$"
)
_DURATION = re.compile(r"^[-+]?((\d+(\.\d+)?|\.\d+)\s*(ns|us|µs|ms|s|m|h|d|w))+$")

FORMATS: dict[str, Callable[[str], bool]] = {
    "date-time": _is_date_time,
    "datetime": _is_date_time,
    "date": _is_date,
    "ipv4": lambda t: _is_ip(t, 4),
    "ipv6": lambda t: _is_ip(t, 6),
    "cidr": _is_cidr,
    "uuid": _is_uuid,
    "uuid3": lambda t: _is_uuid(t, 3),
    "uuid4": lambda t: _is_uuid(t, 4),
    "uuid5": lambda t: _is_uuid(t, 5),
    "byte": _is_base64,
    "hostname": lambda t: len(t) <= 255 and bool(_HOSTNAME.match(t)),
    "email": lambda t: bool(re.fullmatch(r"[^@\s]+@[^@\s]+", t)),
    "mac": lambda t: bool(re.fullmatch(r"(?i)([0-9a-f]{2}[:-]){5}[0-9a-f]{2}", t)),
    "duration": lambda t: bool(_DURATION.match(t)),
}
"""The formats checked (Kubernetes knows a few more: uri, isbn, creditcard, ssn, colours...;
formats it does not know, such as ``int32``, are not checked by a cluster either)."""


@functools.lru_cache(maxsize=512)
def _pattern(text: str) -> re.Pattern[str]:
    return re.compile(text)


class _SchemaCheck:
    """One walk of a value against its schema, collecting errors as kube-openapi words them."""

    def __init__(self) -> None:
        self.errors: list[FieldError] = []

    def add(self, kind: str, name: str, at: Location, value: Any, detail: str = "") -> None:
        self.errors.append(FieldError(kind, name or "<nil>", value, detail, at))

    def invalid(self, name: str, at: Location, value: Any, detail: str) -> None:
        self.add("FieldValueInvalid", name, at, value, f"{name} in body {detail}")

    def walk(self, value: Any, schema: JSON, name: str, at: Location) -> None:
        if value is None:
            if not schema.get("nullable"):
                wanted = self._wanted(schema)
                if wanted:
                    self._type_error(name, at, wanted, "null")
            return
        wanted = self._wanted(schema)
        if wanted == "integer,string":
            if not (_has_type(value, "integer") or isinstance(value, str)):
                self._type_error(name, at, wanted, _json_type(value))
                return
        elif wanted and not _has_type(value, wanted):
            self._type_error(name, at, wanted, _json_type(value))
            return
        if isinstance(value, str):
            self._string(value, schema, name, at)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            self._number(value, schema, name, at)
        if "enum" in schema and not any(_same(value, o) for o in schema["enum"]):
            allowed = [o if isinstance(o, str) else json.dumps(o) for o in schema["enum"]]
            detail = "supported values: " + ", ".join(go_string(a) for a in allowed)
            self.add("FieldValueNotSupported", name, at, value, detail)
        if isinstance(value, list):
            self._array(value, schema, name, at)
        elif isinstance(value, dict):
            self._object(value, schema, name, at)

    @staticmethod
    def _wanted(schema: JSON) -> str:
        if schema.get("x-kubernetes-int-or-string"):
            return "integer,string"
        return str(schema.get("type") or "")

    def _type_error(self, name: str, at: Location, wanted: str, actual: str) -> None:
        detail = f"{name} in body must be of type {wanted}: {go_string(actual)}"
        self.add("FieldValueTypeInvalid", name, at, actual, detail)

    def _string(self, value: str, schema: JSON, name: str, at: Location) -> None:
        length = len(value)  # characters, as kube-openapi counts them (runes)
        if "maxLength" in schema and length > schema["maxLength"]:
            most = schema["maxLength"]
            self.add("FieldValueTooLong", name, at, value, f"may not be longer than {most}")
        if "minLength" in schema and length < schema["minLength"]:
            self.invalid(name, at, value, f"should be at least {schema['minLength']} chars long")
        if "pattern" in schema and not _pattern(schema["pattern"]).search(value):
            self.invalid(name, at, value, f"should match '{schema['pattern']}'")
        check = FORMATS.get(str(schema.get("format") or ""))
        if check is not None and not check(value):
            detail = f"{name} in body must be of type {schema['format']}: {go_string(value)}"
            self.add("FieldValueTypeInvalid", name, at, value, detail)

    def _number(self, value: float, schema: JSON, name: str, at: Location) -> None:
        low, high = schema.get("minimum"), schema.get("maximum")
        if low is not None:
            if schema.get("exclusiveMinimum") and value <= low:
                self.invalid(name, at, value, f"should be greater than {go_number(low)}")
            elif value < low:
                detail = f"should be greater than or equal to {go_number(low)}"
                self.invalid(name, at, value, detail)
        if high is not None:
            if schema.get("exclusiveMaximum") and value >= high:
                self.invalid(name, at, value, f"should be less than {go_number(high)}")
            elif value > high:
                self.invalid(name, at, value, f"should be less than or equal to {go_number(high)}")
        factor = schema.get("multipleOf")
        if factor and (value / factor) != int(value / factor):
            self.invalid(name, at, value, f"should be a multiple of {go_number(factor)}")

    def _array(self, value: list[Any], schema: JSON, name: str, at: Location) -> None:
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            most = schema["maxItems"]
            self.add("FieldValueTooMany", name, at, len(value), f"must have at most {most} items")
        if "minItems" in schema and len(value) < schema["minItems"]:
            self.invalid(name, at, len(value), f"should have at least {schema['minItems']} items")
        items = schema.get("items")
        if isinstance(items, dict):
            for i, item in enumerate(value):
                self.walk(item, items, f"{name}[{i}]", (*at, i))
        list_type = schema.get("x-kubernetes-list-type")
        if list_type in ("map", "set"):
            keys = list(schema.get("x-kubernetes-list-map-keys") or [])
            seen: list[Any] = []
            for i, item in enumerate(value):
                ident = (
                    {k: item.get(k) for k in keys if k in item}
                    if list_type == "map" and isinstance(item, dict)
                    else item
                )
                if ident in seen:
                    self.errors.append(
                        FieldError("FieldValueDuplicate", f"{name}[{i}]", ident, at=(*at, i))
                    )
                else:
                    seen.append(ident)

    def _object(self, value: JSON, schema: JSON, name: str, at: Location) -> None:
        count = len(value)
        if "maxProperties" in schema and count > schema["maxProperties"]:
            most = schema["maxProperties"]
            self.add("FieldValueTooMany", name, at, count, f"must have at most {most} items")
        if "minProperties" in schema and count < schema["minProperties"]:
            least = schema["minProperties"]
            self.invalid(name, at, count, f"should have at least {least} properties")
        for key in schema.get("required") or []:
            if key not in value:  # a null is present (kube-apiserver keeps it where nullable)
                where = f"{name}.{key}" if name else key
                self.errors.append(FieldError("FieldValueRequired", where, at=at))
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            where = f"{name}.{key}" if name else key
            sub = props.get(key)
            if isinstance(sub, dict):
                self.walk(item, sub, where, (*at, key))
            elif isinstance(extra, dict):
                self.walk(item, extra, where, (*at, key))


def schema_errors(obj: JSON, schema: JSON) -> list[FieldError]:
    """What the OpenAPI v3 schema refuses in ``obj`` (pruned and defaulted already)."""
    check = _SchemaCheck()
    body = {k: v for k, v in obj.items() if k != "metadata"}  # ObjectMeta: validated apart
    check.walk(body, {**schema, "properties": _without_metadata(schema)}, "", ())
    return check.errors


def _without_metadata(schema: JSON) -> JSON:
    return {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}


# --------------------------------------------------------------------------------------------
# CEL rules (x-kubernetes-validations)
# --------------------------------------------------------------------------------------------


def _environment(*names: str) -> Any:
    variables = {name: cel.Type.DYN for name in names}
    extensions = [ext_strings.ExtStrings(), ext_bindings.ExtBindings(), ext_optional.ExtOptional()]
    return cel.NewEnv(variables=variables, extensions=extensions)


@functools.cache
def _environments() -> tuple[Any, Any]:
    """CEL environments for rules without and with ``oldSelf`` (built once: they are costly)."""
    return _environment("self"), _environment("self", "oldSelf")


class RuleError(ValueError):
    """A rule (or message expression) that does not compile: the CRD is refused."""


@dataclass(frozen=True)
class Rule:
    """One compiled entry of ``x-kubernetes-validations``."""

    source: JSON
    program: Any
    uses_old_self: bool
    message_program: Any | None

    @property
    def text(self) -> str:
        """``ruleErrorString``: the message if there is one, else the rule."""
        return str(self.source.get("message") or "").strip() or str(self.source["rule"]).strip()

    @property
    def message(self) -> str:
        """``ruleMessageOrDefault``."""
        message = str(self.source.get("message") or "").strip()
        return message or f"failed rule: {self.text}"


def _compile_text(text: str, *, old_self: bool) -> Any:
    without, with_old = _environments()
    try:
        return (with_old if old_self else without).compile(text)
    except RuntimeError as e:
        first = str(e).splitlines()[0].removeprefix("INVALID_ARGUMENT: ")
        raise RuleError(f"compilation failed: {first}") from None


@functools.lru_cache(maxsize=1024)
def _compiled(rule: str, message_expression: str | None) -> tuple[Any, bool, Any | None]:
    try:
        program, uses_old_self = _compile_text(rule, old_self=False), False
    except RuleError as e:
        if not re.search(r"undeclared reference to 'oldSelf[.']", str(e)):
            raise
        program, uses_old_self = _compile_text(rule, old_self=True), True
    if program.return_type() not in (cel.Type.BOOL, cel.Type.DYN):
        returned = program.return_type().name()
        raise RuleError(f"cel expression must evaluate to a bool, not {returned}")
    message = None
    if message_expression:
        message = _compile_text(message_expression, old_self=uses_old_self)
    return program, uses_old_self, message


def compile_rule(source: JSON) -> Rule:
    """One ``x-kubernetes-validations`` entry compiled (cached); raises :class:`RuleError`."""
    if not isinstance(source.get("rule"), str) or not source["rule"].strip():
        raise RuleError("rule must be a non-empty string")
    if source.get("optionalOldSelf"):
        raise RuleError("optionalOldSelf is not supported by this test API server")
    program, uses_old_self, message = _compiled(source["rule"], source.get("messageExpression"))
    return Rule(source, program, uses_old_self, message)


def schema_nodes(schema: JSON, where: str = "") -> Iterator[tuple[str, JSON]]:
    """Every node of a schema with its path (``properties[spec].properties[storage]``)."""
    yield where, schema
    for key, sub in (schema.get("properties") or {}).items():
        if isinstance(sub, dict):
            yield from schema_nodes(sub, f"{where}.properties[{key}]")
    for keyword in ("items", "additionalProperties"):
        sub = schema.get(keyword)
        if isinstance(sub, dict):
            yield from schema_nodes(sub, f"{where}.{keyword}")


def rule_problems(schema: JSON, prefix: str) -> list[FieldError]:
    """Why a CRD's rules would not compile (empty: they all do), as errors on the CRD."""
    errors = []
    for where, node in schema_nodes(schema):
        for i, source in enumerate(node.get("x-kubernetes-validations") or []):
            field = f"{prefix}{where}.x-kubernetes-validations[{i}].rule"
            if not isinstance(source, dict):
                errors.append(FieldError("FieldValueRequired", field))
                continue
            try:
                compile_rule(source)
            except RuleError as e:
                errors.append(FieldError("FieldValueInvalid", field, source.get("rule"), str(e)))
    return errors


def _cel_value(value: Any, schema: JSON | None) -> Any:
    """A JSON value as CEL sees it under its schema: numbers typed by the schema (a ``number``
    is a double even when written 3), date-times as timestamps, ``byte`` strings as bytes."""
    if value is None or not isinstance(schema, dict):
        return value
    kind = schema.get("type")
    if kind == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind == "integer" and isinstance(value, float) and value.is_integer():
        return int(value)
    if kind == "string" and isinstance(value, str):
        fmt = schema.get("format")
        if fmt in ("date-time", "datetime") and _is_date_time(value):
            return datetime.datetime.fromisoformat(value.upper().replace("Z", "+00:00"))
        if fmt == "date" and _is_date(value):
            return datetime.datetime.fromisoformat(value).replace(tzinfo=datetime.UTC)
        if fmt == "byte" and _is_base64(value):
            return base64.b64decode(value)
        return value
    if isinstance(value, list):
        items = schema.get("items")
        return [_cel_value(v, items if isinstance(items, dict) else None) for v in value]
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        other = extra if isinstance(extra, dict) else None
        return {k: _cel_value(v, props.get(k) if k in props else other) for k, v in value.items()}
    return value


def _root_value(obj: JSON, schema: JSON) -> Any:
    """``self`` at a resource's root: of ``metadata``, CEL sees ``name`` and ``generateName``."""
    meta = obj.get("metadata") or {}
    value = _cel_value({k: v for k, v in obj.items() if k != "metadata"}, schema)
    value["metadata"] = {k: meta[k] for k in ("name", "generateName") if k in meta}
    return value


_RULE_FIELD = re.compile(r"\.([A-Za-z_][A-Za-z0-9_-]*)|\['((?:[^'\\]|\\.)*)'\]")


def _rule_field(path: str, schema: JSON) -> str:
    """A rule's ``fieldPath`` (``.name``, ``['key']``) as a suffix of a field path."""
    out, node, pos = "", schema, 0
    while pos < len(path):
        m = _RULE_FIELD.match(path, pos)
        if not m:
            return ""
        pos = m.end()
        key = m[1] if m[1] is not None else m[2].replace("\\'", "'")
        props = node.get("properties") or {}
        if key in props:
            out, node = f"{out}.{key}", props[key]
        elif isinstance(node.get("additionalProperties"), dict):
            out, node = f"{out}[{key}]", node["additionalProperties"]
        else:
            return ""
    return out


def _result_text(result: Any) -> str:
    """An evaluation error as cel-go words the common ones (cel-cpp's words otherwise)."""
    text = str(result.value())
    m = re.fullmatch(r'NOT_FOUND: Key not found in map : "(.*)"', text)
    if m:
        return f"no such key: {m[1]}"
    m = re.fullmatch(r"UNKNOWN: Index error: index=(-?\d+) size=\d+", text)
    if m:
        return f"index out of bounds: {m[1]}"
    return re.sub(r"^[A-Z_]+: ", "", text)


def _child_path(path: str, key: str) -> str:
    return key if path == "<nil>" else f"{path}.{key}"


class _RuleCheck:
    """One walk of the new value (and the old one, where it correlates) through the schema's
    ``x-kubernetes-validations``, as kube-apiserver's CEL validator walks them."""

    def __init__(self, schema: JSON) -> None:
        self.root_schema = schema
        self.errors: list[FieldError] = []

    def walk(
        self, value: Any, old: Any, schema: JSON, path: str, at: Location, *, root: bool = False
    ) -> None:
        if value is None:
            return  # rules see non-null values only
        rules = schema.get("x-kubernetes-validations") or []
        if rules:
            self._evaluate(value, old, schema, path, at, rules, root)
        if isinstance(value, dict):
            props = schema.get("properties") or {}
            extra = schema.get("additionalProperties")
            correlates = schema.get("x-kubernetes-map-type") != "atomic" and isinstance(old, dict)
            for key, item in value.items():
                if root and key == "metadata":
                    continue
                old_item = old.get(key) if correlates else None
                if isinstance(props.get(key), dict):
                    self.walk(item, old_item, props[key], _child_path(path, key), (*at, key))
                elif isinstance(extra, dict):
                    self.walk(item, old_item, extra, f"{path}[{key}]", (*at, key))
        elif isinstance(value, list) and isinstance(schema.get("items"), dict):
            keys = schema.get("x-kubernetes-list-map-keys") or []
            is_map = schema.get("x-kubernetes-list-type") == "map"
            olds = old if is_map and isinstance(old, list) else []
            for i, item in enumerate(value):
                old_item = next(
                    (
                        o
                        for o in olds
                        if isinstance(o, dict)
                        and isinstance(item, dict)
                        and all(o.get(k) == item.get(k) for k in keys)
                    ),
                    None,
                )
                self.walk(item, old_item, schema["items"], f"{path}[{i}]", (*at, i))

    def _evaluate(
        self,
        value: Any,
        old: Any,
        schema: JSON,
        path: str,
        at: Location,
        sources: list[JSON],
        root: bool,
    ) -> None:
        kind = str(schema.get("type") or "")
        data: JSON = {"self": _root_value(value, schema) if root else _cel_value(value, schema)}
        if old is not None:
            data["oldSelf"] = _root_value(old, schema) if root else _cel_value(old, schema)
        for source in sources:
            try:
                rule = compile_rule(source)
            except RuleError as e:
                detail = f"rule compile error: {e}"
                self.errors.append(FieldError("FieldValueInvalid", path, kind, detail, at))
                continue
            if rule.uses_old_self and old is None:
                continue  # a transition rule: only where an old value correlates
            result = rule.program.eval(data=data)
            if result.type() == cel.Type.ERROR:
                detail = f"{_result_text(result)} evaluating rule: {rule.text}"
                self.errors.append(FieldError("FieldValueInvalid", path, kind, detail, at))
                continue
            if result.value() is True:
                continue
            detail = rule.message
            if rule.message_program is not None:
                message = rule.message_program.eval(data=data)
                text = str(message.value()).strip() if message.type() == cel.Type.STRING else ""
                if text and "\n" not in text:
                    detail = text
            where = path
            if source.get("fieldPath"):
                suffix = _rule_field(str(source["fieldPath"]), schema)
                where = (suffix.lstrip(".") if path == "<nil>" else path + suffix) or path
            reason = source.get("reason") or "FieldValueInvalid"
            ratchets = not rule.uses_old_self
            if reason in ("FieldValueForbidden", "FieldValueRequired"):
                error = FieldError(reason, where, OMITTED, detail, at, ratchets)
            elif reason == "FieldValueDuplicate":
                error = FieldError(reason, where, kind, "", at, ratchets)
            else:
                error = FieldError("FieldValueInvalid", where, kind, detail, at, ratchets)
            self.errors.append(error)


def rule_errors(obj: JSON, old: JSON | None, schema: JSON) -> list[FieldError]:
    """What the schema's CEL rules refuse in ``obj``; transition rules need ``old``."""
    check = _RuleCheck(schema)
    check.walk(obj, old, schema, "<nil>", (), root=True)
    return check.errors


# --------------------------------------------------------------------------------------------
# Everything together
# --------------------------------------------------------------------------------------------


def _at(value: Any, location: Location) -> tuple[bool, Any]:
    for step in location:
        if not isinstance(value, dict if isinstance(step, str) else list):
            return False, None
        try:
            value = value[step]
        except (KeyError, IndexError):
            return False, None
    return True, value


def _unchanged(new: JSON, old: JSON, location: Location) -> bool:
    """Whether the value at ``location`` is the same in both objects. Only object fields and
    map entries correlate (list items are compared through their list, the nearest value that
    correlates), as kube-apiserver's ratcheting correlates them."""
    first_index = next((i for i, s in enumerate(location) if isinstance(s, int)), len(location))
    steps = location[:first_index]
    found_new, new_value = _at(new, steps)
    found_old, old_value = _at(old, steps)
    return found_new and found_old and new_value == old_value


def validate(obj: JSON, old: JSON | None, schema: JSON) -> list[FieldError]:
    """Why kube-apiserver would refuse to store ``obj`` (pruned and defaulted) in place of
    ``old`` (None on a create) under the CRD version's ``openAPIV3Schema``; empty if it would
    not. Schema errors come first; CEL rules are evaluated only if none of them is a missing,
    mistyped, unsupported, too long or too many value. On an update, errors about values equal
    to their old values are dropped, except those of transition rules (ratcheting)."""

    def ratcheted(errors: list[FieldError]) -> list[FieldError]:
        if old is None:
            return errors
        return [e for e in errors if not (e.ratchets and e.at and _unchanged(obj, old, e.at))]

    errors = ratcheted(schema_errors(obj, schema))
    if any(e.type in _BLOCKING for e in errors):
        return [*errors, FieldError("FieldValueInvalid", "<nil>", None, RULES_NOT_CHECKED)]
    return errors + ratcheted(rule_errors(obj, old, schema))


_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
DNS_SUBDOMAIN_MESSAGE = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or "
    "'.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used "
    r"for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)


def name_errors(name: str) -> list[FieldError]:
    """``metadata.name`` of a custom resource: a DNS subdomain (RFC 1123) of 253 characters
    at most, as kube-apiserver requires of every custom resource."""
    errors = []
    if len(name) > 253:
        detail = "must be no more than 253 characters"
        errors.append(FieldError("FieldValueInvalid", "metadata.name", name, detail))
    if not _DNS_SUBDOMAIN.fullmatch(name):
        errors.append(FieldError("FieldValueInvalid", "metadata.name", name, DNS_SUBDOMAIN_MESSAGE))
    return errors
