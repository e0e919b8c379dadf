"""The one exception every configuration problem raises (files, fields, environment variables)."""
from __future__ import annotations

from pathlib import Path


class ConfigError(ValueError):
    """A configuration problem: ``file: field: what is wrong``."""

    def __init__(self, file: str | Path, field_path: str, problem: str) -> None:
        self.file, self.field_path, self.problem = str(file), field_path, problem
        super().__init__(f"{file}: {field_path}: {problem}")
