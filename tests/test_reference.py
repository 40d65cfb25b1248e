"""docs/config.md and docs/cli.md are generated from the code (console/reference.py): a page that differs from what
the schema and the parser produce now fails here; `make docs` writes them again."""
from __future__ import annotations

from pathlib import Path

import pytest

from console.reference import PAGES

DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.mark.parametrize("name", sorted(PAGES))
def test_the_committed_reference_page_is_what_the_code_produces(name):
    page = DOCS / name
    assert page.exists(), f"{page} is missing: run `make docs`"
    assert page.read_text() == PAGES[name](), f"{page} differs from the code: run `make docs` and commit it"


def test_every_key_of_the_schema_is_in_the_config_reference():
    from engine.config.schema import RunConfig

    text = (DOCS / "config.md").read_text()
    for key, field in RunConfig.model_fields.items():
        # a section, or an optional one ([slurm]: Slurm | None)
        section = next((a for a in (field.annotation, *getattr(field.annotation, "__args__", ()))
                        if hasattr(a, "model_fields")), None) if key != "hosts" else None
        if section is not None:
            assert f"## [{key}]" in text
            for sub in section.model_fields:
                assert f"| `{sub}` |" in text, f"[{key}] {sub}"
        elif key != "hosts":
            assert f"| `{key}` |" in text
