"""vramd: moves GPU buffer-object contents to and from checkpoint images."""

__version__ = "0.1.0"
