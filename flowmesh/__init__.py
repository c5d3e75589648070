"""flowmesh: the shared wire protocol, common types and example models."""

__version__ = "0.1.0"
