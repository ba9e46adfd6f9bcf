"""`igrpo COMMAND --help`'s list of config keys: each key of the sections a command reads, with
its default and the first sentence of its docstring in configs/schema.py (the string literal
after the field, read from the schema's source with `ast`)."""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path

from configs import schema
from configs.schema import Config

ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "vs.", "cf.")


@functools.lru_cache(maxsize=1)
def field_docs() -> dict[tuple[str, str], str]:
    """(schema class name, field name) -> the field's docstring, whitespace collapsed."""
    tree = ast.parse(Path(schema.__file__).read_text(encoding="utf-8"))
    docs = {}
    for cls in (node for node in tree.body if isinstance(node, ast.ClassDef)):
        for stmt, after in zip(cls.body, cls.body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[(cls.name, stmt.target.id)] = " ".join(after.value.value.split())
    return docs


def first_sentence(text: str, at_least: int = 48) -> str:
    """`text` up to its first full stop outside brackets (an "e.g." is no full stop) that ends at
    least `at_least` characters in (a label such as "Study key (...)." takes the next sentence)."""
    depth = 0
    for i, char in enumerate(text):
        depth += (char in "([") - (char in ")]")
        if (char == "." and depth <= 0 and i + 1 >= at_least and text[i + 1:i + 2] in ("", " ")
                and not text[:i + 1].endswith(ABBREVIATIONS)):
            return text[:i + 1]
    return text


def section_keys(section: str) -> list[tuple[str, object, str]]:
    """(dotted key, default, docstring) of every leaf key of a top-level config section, in the
    schema's order (nested sections such as `model.tiny` inline)."""
    top = {f.name: f for f in fields(Config)}[section]
    return _keys(top.default_factory(), f"{section}.")  # type: ignore[misc]


def _keys(node, prefix: str) -> list[tuple[str, object, str]]:
    out = []
    for f in fields(node):
        value = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        if is_dataclass(value):
            out += _keys(value, f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", value,
                        field_docs().get((type(node).__name__, f.name), "")))
    return out


def key_help(sections: tuple[str, ...] | list[str], ignored: tuple[str, ...] = (),
             width: int = 110) -> str:
    """One line per key of `sections` (a blank line between sections): `key = default` and the
    first sentence of its docstring, cut to `width` columns; a key in `ignored` is marked so."""
    blocks = [[(f"  {key} = {default!r}", "(ignored by this command: another key decides)"
                if key in ignored else first_sentence(doc))
               for key, default, doc in section_keys(section)] for section in sections]
    column = min(max((len(left) for rows in blocks for left, _ in rows), default=0), 44) + 3
    out = []
    for rows in blocks:
        for left, doc in rows:
            room = max(width - max(len(left) + 3, column), 32)
            doc = doc if len(doc) <= room else re.sub(r"\s+\S*$", "", doc[:room - 3]) + "..."
            out.append(f"{left:<{column - 3}}   {doc}".rstrip())
        out.append("")
    return "\n".join(out[:-1])
