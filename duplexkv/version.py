"""The package's version, in a module of its own at the bottom layer: `/version` (http) and the CLI
read it without importing the package root (whose lazy names lead to the engine)."""

__version__ = "0.1.0"
