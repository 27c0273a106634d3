"""Session-scoped tiny checkpoints of every family (``families``), built on first use."""

from pathlib import Path

import pytest

from tests.models.families import BY_NAME, save_draft, save_tiny


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``tiny_checkpoint(name)``: the directory of family ``name``'s tiny checkpoint."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = save_tiny(BY_NAME[name], tmp_path_factory.mktemp(name))
        return made[name]

    return get


@pytest.fixture(scope="session")
def tiny_draft(tiny_checkpoint, tmp_path_factory):
    """``tiny_draft(name)``: a draft checkpoint of the same family (the target's first 2 layers)."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = save_draft(tiny_checkpoint(name), tmp_path_factory.mktemp(f"{name}-draft"))
        return made[name]

    return get
