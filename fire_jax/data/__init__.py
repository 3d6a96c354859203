"""FIRE data layer: records, chat rendering with loss masks, anyres images, TFDS, input pipeline.

- ``records``: typed FIRE conversations / LLaVA-style instructions from JSON(L), score parsing, bad-record counts.
- ``chat``: student and teacher sequences (FIRE Eqs. 5-6) in the chat template; ``ChatTokenizer`` (ids, loss mask).
- ``images``: any-resolution tiles equal to transformers' ``LlavaNextImageProcessorPil``.
- ``tfds_fire``: the tensorflow-datasets builder (array_record, no TensorFlow) and its reader.
- ``pipeline``: grain input pipeline -> fixed-shape numpy batches; ``config``: data config + sources.
- ``synthetic`` / ``tokenizer``: the shipped synthetic demo set and tiny BPE tokenizer.
- ``python -m fire_jax.data.inspect``: print one rendered example.

Plain Python + numpy (+ PIL, tokenizers, grain, tfds); this package never imports jax itself
(grain, used by ``pipeline``, does).
"""
