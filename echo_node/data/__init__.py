"""Data files that ship with the package (see pyproject's package-data), and their generators."""
