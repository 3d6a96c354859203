"""The main job's stages: CLIP, base, teacher and student training, evaluations and the summary.
"""
