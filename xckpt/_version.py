"""The package version: one place, read by `xckpt.__version__`, `xckpt --version` and the
build (pyproject `[tool.setuptools.dynamic]`)."""

__version__ = "0.1.0"
