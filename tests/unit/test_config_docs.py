"""docs/configuration.md stays the config's: every key in one table row, no key the config lacks."""

import dataclasses
import re
import typing
from pathlib import Path

from app.config import AppConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
GROUPS = ("prefill", "decode", "router")


def config_keys(cls=AppConfig, prefix="") -> set[str]:
    keys = set()
    for name, kind in typing.get_type_hints(cls, include_extras=True).items():
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            keys |= config_keys(kind, f"{prefix}{name}.")
        else:
            keys.add(prefix + name)
    return keys


def documented(section: str) -> list[str]:
    """The keys in the first cell of each table row of `section` (`<group>` expanded where such keys exist)."""
    keys = []
    for row in re.findall(r"^\| (.+?) \|", section, flags=re.MULTILINE):
        for key in re.findall(r"`([a-z_.<>]+)`", row):
            expanded = [key.replace("<group>", group) for group in GROUPS] if "<group>" in key else [key]
            keys += [k for k in expanded if k in config_keys()] if "<group>" in key else expanded
    return keys


def _sections() -> tuple[str, str]:
    text = DOC.read_text().split("## Request extensions and endpoints")[0]
    day_one, advanced = text.split("## Day one")[1].split("## Advanced")
    return day_one, advanced


def test_every_key_is_documented_once_and_every_documented_key_exists():
    day_one, advanced = _sections()
    keys = documented(day_one) + documented(advanced)
    assert sorted(k for k in set(keys) if keys.count(k) > 1) == [], "documented twice"
    assert sorted(set(keys) - config_keys()) == [], "documented, not in the config"
    assert sorted(config_keys() - set(keys)) == [], "in the config, not documented"


def test_the_day_one_table_is_short():
    assert len(re.findall(r"^\| `", _sections()[0], flags=re.MULTILINE)) <= 15
