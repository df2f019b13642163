"""pyproject.toml lists every package of ssmc and the templates beside them, so that an install that
is not editable (a wheel, CI's fresh environment) has every module and `.cu.j2` file."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_is_listed():
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "ssmc").rglob("__init__.py")}
    listed = set(_setuptools()["packages"]) - {"ssmc.examples"}
    assert found == listed, f"missing: {sorted(found - listed)}, stale: {sorted(listed - found)}"


def test_every_template_folder_ships_its_templates():
    data = _setuptools()["package-data"]
    for template in (ROOT / "ssmc").rglob("*.j2"):
        folder = template.parent.relative_to(ROOT)
        package = ".".join(folder.parts)
        own = any(template.match(pattern) for pattern in data.get(package, []))
        top = any(template.relative_to(ROOT / "ssmc").match(pattern) for pattern in data.get("ssmc", []))
        assert own or top, f"{template.relative_to(ROOT)}: no package-data pattern of {package} ships it"
