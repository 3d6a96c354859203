"""Every logical axis name, defined once (as MaxText defines its logical axes): the models name their weights'
and activations' axes with these, the inference engine its KV cache's, and ``fire_jax.core.config.DEFAULT_RULES``
maps them onto the mesh's axes (:data:`MESH_AXES`: data, fsdp, tensor)."""

# The mesh.
DATA, FSDP, TENSOR = "data", "fsdp", "tensor"
MESH_AXES = (DATA, FSDP, TENSOR)

# Activations and the KV cache.
BATCH = "batch"  # a training batch's rows
SLOTS = "slots"  # an inference engine's cache rows (decode slots)

# The LLM's weights.
EMBED = "embed"  # the model dimension
HEADS = "heads"  # query heads x head dim
KV_HEADS = "kv_heads"  # key / value heads x head dim
MLP = "mlp"  # the MLP's hidden dimension
VOCAB = "vocab"
NORM = "norm"  # a norm's scale (replicated)

# The vision tower's weights.
VISION_EMBED = "vision_embed"
VISION_HEADS = "vision_heads"
VISION_MLP = "vision_mlp"
