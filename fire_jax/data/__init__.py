"""FIRE data layer: records, chat rendering with loss masks, anyres images, TFDS, input pipeline.

- ``records``: typed FIRE conversations / LLaVA-style instructions: the schema, ``parse_record``, ``to_raw``, loading.
- ``scores``: the teacher's score a_i and the feedback text of a feedback f_i; ``bad_records``: bad-record errors and
  counts; ``jsonl``: the streaming JSON-array / JSONL reader every record reader loops over; ``image_files``: the
  image checks (inside the root, present, readable); ``filters``: which generated conversations are kept.
- ``items``: the (I, q, gt) triplets of dialogues and generation.
- ``chat``: student and teacher sequences (FIRE Eqs. 5-6) in the chat template; ``ChatTokenizer`` (ids, loss mask).
- ``images``: any-resolution tiles equal to transformers' ``LlavaNextImageProcessorPil``.
- ``tfds_fire``: the tensorflow-datasets builder (array_record, no TensorFlow) and its reader.
- ``pipeline``: grain input pipeline -> fixed-shape numpy batches; ``config``: data config + sources.
- ``synthetic`` / ``tokenizer``: the shipped synthetic demo set and tiny BPE tokenizer.

``python -m fire_jax.inspect_data`` prints one rendered example.

Plain Python + numpy (+ PIL, tokenizers, grain, tfds); this package never imports jax itself
(grain, used by ``pipeline``, does).
"""
