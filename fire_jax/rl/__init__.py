"""The student's reinforcement stage: rollouts of sampled dialogues with the trained weights, rewards from any
teacher's scores, the one trainer's step with the ``"rl"`` objective (:mod:`fire_jax.train.policy`)."""
