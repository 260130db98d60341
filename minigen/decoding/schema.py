"""A JSON schema (a subset of JSON Schema) -> a regular expression of automaton.py's subset.

A regular expression cannot count brackets, but a schema fixes the nesting: every object and array
in it is spelled out, so its JSON texts form a regular language. The regex writes one layout of the
JSON text (the one llguidance writes with {"whitespace_flexible": false, "key_separator": ": ",
"item_separator": ", "}, so that both backends accept the same strings):
- no whitespace, except exactly ": " after a key and ", " between items and properties;
- an object's properties in the order of "properties", the required ones always, an optional one
  present or absent, and no other: every object must say "additionalProperties": false (JSON Schema
  lets any other property appear where it is absent, as llguidance does; OpenAI's strict mode asks
  for false on every object too);
- a string: any character but " \\, the controls U+0000..U+001F and DEL, or an escape (\\" \\\\ \\b
  \\f \\n \\r \\t, \\u00XX for a control or DEL); minLength / maxLength count characters (an escape is one);
- a number -?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?, an integer -?(0|[1-9][0-9]*);
- true, false, null; enum and const of any JSON value (written with the separators above);
- an array of "items" with minItems / maxItems.
A keyword outside the subset (anyOf, $ref, pattern, format, minimum, additionalProperties true, ...)
is a ConfigError naming it: guided_backend="llguidance" takes the full language.
"""

from __future__ import annotations

import json

from minigen.errors import ConfigError

# Keywords that only describe a value: they never change which texts are valid.
ANNOTATIONS = {"title", "description", "$schema", "$id", "$comment", "examples", "default", "readOnly",
               "writeOnly", "deprecated"}
# The keywords this subset implements, per type ("enum" and "const" go with any type).
KEYWORDS = {
    "object": {"type", "properties", "required", "additionalProperties"},
    "array": {"type", "items", "minItems", "maxItems"},
    "string": {"type", "minLength", "maxLength"},
    "number": {"type"}, "integer": {"type"}, "boolean": {"type"}, "null": {"type"},
}
METACHARACTERS = set("\\.^$|?*+()[]{}")

INTEGER = r"-?(0|[1-9][0-9]*)"
NUMBER = INTEGER + r"(\.[0-9]+)?([eE][+-]?[0-9]+)?"
# One character of a JSON string (RFC 8259 §7), as llguidance writes one: unescaped (not ", \, a
# control U+0000..U+001F or DEL), or an escape of a character that needs one (\u only for the controls
# and DEL). Valid JSON either way; one layout per character leaves the model no choice that means nothing.
STRING_CHAR = r'([^"\\\x00-\x1f\x7f]|\\["\\bfnrt]|\\u00[01][0-9a-fA-F]|\\u007[fF])'
SCALARS = {"number": NUMBER, "integer": INTEGER, "boolean": "(true|false)", "null": "null"}


def refuse(keyword: str, why: str) -> ConfigError:
    return ConfigError(f"response_format's JSON schema: {keyword} {why}; minigen's own backend takes a subset "
                       "(decoding/schema.py); use guided_backend=\"llguidance\" for the full JSON Schema")


def escape(text: str) -> str:
    """A regex that matches exactly `text`."""
    return "".join("\\" + c if c in METACHARACTERS else c for c in text)


def dump(value) -> str:
    """A JSON value written in the layout of this module (": " and ", ", UTF-8 kept as is)."""
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def schema_to_regex(schema) -> str:
    """The regex whose matches are exactly the JSON texts (in this module's layout) valid under `schema`."""
    if not isinstance(schema, dict):
        raise refuse(f"the schema {schema!r}", "is not an object (true and false schemas included)")
    unknown = sorted(k for k in schema if k not in ANNOTATIONS and k not in {"enum", "const"}
                     and not any(k in keys for keys in KEYWORDS.values()))
    if unknown:
        raise refuse(f"the keyword {unknown[0]!r}", "is outside the subset")
    if "const" in schema:
        return escape(dump(schema["const"]))
    if "enum" in schema:
        if not isinstance(schema["enum"], list) or not schema["enum"]:
            raise refuse("enum", "must be a non-empty list")
        return "(" + "|".join(escape(dump(v)) for v in schema["enum"]) + ")"
    kind = schema.get("type")
    if isinstance(kind, list) and kind and all(isinstance(k, str) for k in kind):  # "type": ["string", "null"]
        return "(" + "|".join(schema_to_regex({**schema, "type": k}) for k in kind) + ")"
    if kind not in KEYWORDS:
        raise refuse(f"type {kind!r}", "is not one of " + ", ".join(KEYWORDS) + " (a schema without a type "
                     "accepts any JSON value)")
    extra = sorted(k for k in schema if k not in KEYWORDS[kind] and k not in ANNOTATIONS)
    if extra:
        raise refuse(f"the keyword {extra[0]!r}", f"is outside the subset for type {kind!r}")
    if kind == "object":
        return object_regex(schema)
    if kind == "array":
        return array_regex(schema)
    if kind == "string":
        return string_regex(schema)
    return SCALARS[kind]


def count(schema: dict, key: str, default: int | None) -> int | None:
    """A non-negative integer keyword such as minItems, or its default."""
    value = schema.get(key, default)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise refuse(f"{key}={value!r}", "must be a non-negative integer")
    return value


def repeat(item: str, low: int, high: int | None, separator: str) -> str:
    """`low` to `high` (None: any number of) items joined by `separator`."""
    more = "*" if high is None else "{%d,%d}" % (max(low - 1, 0), high - 1)
    if high == 0:
        return ""
    joined = f"{item}({separator}{item}){more}"
    return joined if low > 0 else f"({joined})?"


def string_regex(schema: dict) -> str:
    low, high = count(schema, "minLength", 0), count(schema, "maxLength", None)
    if high is not None and high < low:
        raise refuse(f"maxLength={high}", f"is below minLength={low}")
    quantifier = "*" if (low, high) == (0, None) else "{%d,%s}" % (low, "" if high is None else high)
    return f'"{STRING_CHAR}{quantifier}"'


def array_regex(schema: dict) -> str:
    if "items" not in schema:
        raise refuse("an array without 'items'", "accepts any JSON value as an item")
    low, high = count(schema, "minItems", 0), count(schema, "maxItems", None)
    if high is not None and high < low:
        raise refuse(f"maxItems={high}", f"is below minItems={low}")
    return r"\[" + repeat(schema_to_regex(schema["items"]), low, high, ", ") + r"\]"


def object_regex(schema: dict) -> str:
    """Properties in schema order joined by ", ": required ones always, optional ones maybe."""
    if schema.get("additionalProperties", False) is not False:
        raise refuse("additionalProperties", "other than false is outside the subset (no additional properties)")
    if "properties" not in schema and "additionalProperties" not in schema:
        raise refuse("an object without 'properties'", "accepts any object (json_object too)")
    if "additionalProperties" not in schema:
        raise refuse("an object without \"additionalProperties\": false", "lets any other property appear "
                     "(JSON Schema's default), which the subset never writes: add \"additionalProperties\": false")
    properties, required = schema.get("properties", {}), schema.get("required", [])
    missing = [name for name in required if name not in properties]
    if missing:
        raise refuse(f"required {missing[0]!r}", "names no property, and no additional property may appear")
    members = [(escape(dump(name)) + ": " + schema_to_regex(sub), name in required)
               for name, sub in properties.items()]
    return r"\{" + members_regex(members) + r"\}"


def members_regex(members: list[tuple[str, bool]]) -> str:
    """The properties from the first of `members` on, (regex, required) each, before any was written.

    After the first written property each later one is `(, p)?` or `, p`: linear in size. Before it,
    an optional property either starts the list or is skipped: quadratic only in the optional
    properties that come before the first required one."""
    if not members:
        return ""
    after = "".join(f"(, {p})" + ("" if needed else "?") for p, needed in members[1:])
    first, needed = members[0]
    if needed:
        return first + after
    return f"({first}{after}|{members_regex(members[1:])})" if len(members) > 1 else f"({first})?"
