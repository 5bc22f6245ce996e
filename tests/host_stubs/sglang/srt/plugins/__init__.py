"""sglang.srt.plugins: entry points of the group `sglang.srt.plugins`, filtered by
SGLANG_PLUGINS, each called with no argument in every scheduler process."""

import os
from importlib.metadata import entry_points


def load_plugins() -> None:
    allowed = os.environ.get("SGLANG_PLUGINS")
    allowed = None if allowed is None else allowed.split(",")
    for plugin in entry_points(group="sglang.srt.plugins"):
        if allowed is None or plugin.name in allowed:
            plugin.load()()
