"""The partitioner: reads a model as a chain of blocks, profiles it and plans stages or chunks.

Importing the package imports no torch: `costs`, `planners` and `plan` are plain data and pure
functions the broker can use; `chain`, `profile` and `stages` need torch and are imported by name.
"""
