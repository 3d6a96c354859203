"""A model's weights: building a config's model (``build``), laying weights and batches out on the mesh
(``sharding``), saving and restoring a train workdir's weights with orbax (``checkpoint``).
"""
