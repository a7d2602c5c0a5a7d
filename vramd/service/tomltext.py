"""Values as TOML writes them: the effective configuration `vramd --check-config` prints, and the values the
configuration's one-line errors quote (`true`, not Python's `True`; strings in double quotes)."""
from __future__ import annotations

from typing import Any


def show(v: object) -> str:
    """A value as TOML writes it (true, not Python's True; "text" in double quotes), for messages."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(show(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {show(x)}" for k, x in v.items()) + "}"
    return repr(v)


def to_toml(values: dict[str, Any]) -> str:
    """`values` (DaemonConfig.effective()) as a TOML document; None values as comments."""
    def fmt(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(fmt(x) for x in v) + "]"
        raise TypeError(type(v))
    lines, tables = [], []
    for k, v in values.items():
        if isinstance(v, dict):
            tables.append(f"\n[{k}]")
            tables += [f"{name} = {fmt(on)}" for name, on in sorted(v.items())]
        elif v is None:
            lines.append(f"# {k} is not set")
        else:
            lines.append(f"{k} = {fmt(v)}")
    return "\n".join(lines + tables) + "\n"
