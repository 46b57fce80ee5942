"""In-tree build backend of the dte Python package (see pyproject.toml)."""
