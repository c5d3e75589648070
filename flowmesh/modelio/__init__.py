"""Model I/O, the bottom floor every process builds on: a `ModelSpec` turned into torch modules,
weights read from safetensors files and Hugging Face directories, the model read as a chain of
blocks (adapters, torch.fx), one stage of a plan materialised, a chain profiled, and the plans
that cut it (the type, and the chunk planning a training worker does itself).

Each module imports only modules listed before it, so none needs a function-level import to
dodge a cycle (tests/test_import_graph.py fails on any cycle): dtypes, weights, inputs,
sequential, fx_chain, hf_adapters, chain, hf_dir, build, costs, planners, plan, profile, stages.

Importing the package imports nothing; `costs`, `planners` and `plan` are plain data and pure
functions without torch, so the broker can read plans; the other modules need torch.
"""
