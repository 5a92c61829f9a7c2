"""JSON-schema string formats whose text the constraint engine (llguidance) admits beyond what the format means: its
date, time and date-time patterns take each month's days up to 29 whatever the year (2023-02-29), year 0000 and
the leap second 60, none of which is a date or time a reader (Python's datetime, jsonschema's format checker)
takes. Each such format gets, beside it, an anchored pattern of the calendar as RFC 3339 and Python read it
(proleptic Gregorian years 0001-9999, seconds 00-59); the engine generates text that matches both."""

from __future__ import annotations

from typing import Any

from .schema_walk import SCHEMA_DATA

# Years 0001-9999; a leap year is divisible by 4 and not by 100, or by 400
_YEAR = "(?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = (f"(?:{_YEAR}-(?:(?:0[1-9]|1[0-2])-(?:0[1-9]|1[0-9]|2[0-8])|(?:0[13-9]|1[0-2])-(?:29|30)"
         f"|(?:0[13578]|1[02])-31)|{_LEAP_YEAR}-02-29)")
_TIME = "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]+)?(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
FORMAT_PATTERNS = {"date": f"^{_DATE}$", "time": f"^{_TIME}$", "date-time": f"^{_DATE}[Tt]{_TIME}$"}


def exact_formats(schema: Any) -> bool:
    """Adds to every subschema of ``schema`` whose "format" is in FORMAT_PATTERNS an allOf member with that
    format's pattern; whether any was added. Edited in place. Iterative: a schema may nest deeply."""
    changed = False
    stack = [schema]
    while stack:
        s = stack.pop()
        if isinstance(s, list):
            stack.extend(s)
            continue
        if not isinstance(s, dict):
            continue
        stack.extend(v for k, v in s.items() if k not in SCHEMA_DATA and isinstance(v, (dict, list)))
        pattern = FORMAT_PATTERNS.get(s.get("format")) if isinstance(s.get("format"), str) else None
        if pattern is not None and isinstance(s.get("allOf", []), list):
            s["allOf"] = s.get("allOf", []) + [{"pattern": pattern}]
            changed = True
    return changed
