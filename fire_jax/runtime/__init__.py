"""Models on devices: the mesh and shardings, building a config's model, orbax checkpoints.
"""
