"""docs/configuration.md is generated from the config Structs and must match them."""

from __future__ import annotations

import inspect
import runpy
from pathlib import Path

import msgspec

import astrai.config
import astrai.data.config

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = runpy.run_path(str(ROOT / "programs" / "config_docs.py"))


def test_configuration_md_is_up_to_date():
    committed = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert committed == SCRIPT["render"](), (
        "docs/configuration.md differs from the config Structs; "
        "refresh it with: python programs/config_docs.py"
    )


def test_every_config_struct_is_documented():
    structs = {
        obj
        for module in (astrai.config, astrai.data.config)
        for obj in vars(module).values()
        if inspect.isclass(obj)
        and issubclass(obj, msgspec.Struct)
        and obj.__module__ == module.__name__
    }
    text = SCRIPT["render"]()
    missing = sorted(s.__name__ for s in structs if f"(`{s.__name__}`)" not in text)
    assert not missing, f"reach these Structs from SECTIONS in programs/config_docs.py: {missing}"
