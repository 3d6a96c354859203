"""Image files named by records: inside the image root (no way out through ``..`` or links), present, readable."""

from __future__ import annotations

import io
import os

from PIL import Image

from fire_jax.data.bad_records import BadRecordError


def image_size_of(path_or_bytes: str | bytes, *, decode: bool = False) -> tuple[int, int]:
    """(height, width) of an image file, reading the header (or everything with ``decode``)."""
    stream = io.BytesIO(path_or_bytes) if isinstance(path_or_bytes, bytes) else path_or_bytes
    with Image.open(stream) as image:
        if decode:
            image.load()
        return image.height, image.width


def outside_root(image_root: str, image: str) -> str | None:
    """Why ``image`` (a path relative to ``image_root``) leads out of the root, or None when it does not: the one
    check of every tool that reads images named by its input (training and evaluation data, batch prompts,
    VLRMBench records). An absolute path or one whose ``..`` climbs out is refused by its name, before anything
    is looked at; one that leads out through a symbolic link (``images/x.jpg -> /elsewhere/x.jpg``, or a linked
    folder on the way) by where it resolves to (``os.path.realpath``), compared with the resolved root."""
    if "\0" in image:
        return f"{image!r} holds a NUL character"
    root = os.path.normpath(os.path.abspath(image_root or "."))
    path = os.path.normpath(os.path.join(root, image))
    if os.path.isabs(image) or os.path.commonpath([root, path]) != root:
        return f"{image!r} is not inside the image root {root}"
    real_root, real = os.path.realpath(root), os.path.realpath(path)
    if os.path.commonpath([real_root, real]) != real_root:
        return f"{image!r} is a symbolic link out of the image root {root} (to {real})"
    return None


def image_path(image_root: str, image: str, where: str) -> str:
    """``image`` joined to ``image_root``; ``image_outside_root`` when it leads out of the root
    (:func:`outside_root`)."""
    why = outside_root(image_root, image)
    if why:
        raise BadRecordError("image_outside_root", where, "image", why)
    return os.path.normpath(os.path.join(os.path.abspath(image_root or "."), image))


def check_image(record, image_root: str, where: str, *, decode: bool = False) -> str | None:
    """The absolute image path of a record (anything with ``image``: a path relative to ``image_root``, or None);
    raises image_outside_root / missing_image / unreadable_image."""
    if record.image is None:
        return None
    path = image_path(image_root, record.image, where)
    if not os.path.isfile(path):
        raise BadRecordError("missing_image", where, "image", path)
    try:
        image_size_of(path, decode=decode)
    except Exception as e:  # PIL raises many types for broken files
        raise BadRecordError("unreadable_image", where, "image", f"{path}: {e}") from None
    return path
