"""The partitioner: the process that profiles a model's chain and plans stages or chunks on request.

Model reading, profiling, the plan type and chunk planning live on the bottom floor
(`flowmesh.modelio`), shared with the workers; the pipeline-stage planners are its own
(`stage_planners`, `stage_plans`). Importing the package imports no torch.
"""
