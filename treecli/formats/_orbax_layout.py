"""What Orbax's reader and writer share: the names of the files Orbax writes in a
checkpoint, and the name it stores a leaf under."""

from __future__ import annotations

import re

OWNED = re.compile(r"_CHECKPOINT_METADATA|_METADATA|_ROOT_METADATA|_strings\.json|_sharding|commit_success\.txt"
                   r"|manifest\.ocdbt|d|ocdbt\.process_\d+|array_metadatas|descriptor")


def param_name(keypath: tuple) -> str:
    """The name Orbax stores a leaf under: its keys joined with ``.``."""
    return ".".join(str(k) for k in keypath)
