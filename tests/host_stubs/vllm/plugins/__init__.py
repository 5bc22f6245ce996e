"""vllm.plugins as 0.34 has it: general plugins are entry points of the group
`vllm.general_plugins`, loaded once per process, filtered by VLLM_PLUGINS."""

import logging
import os
from importlib.metadata import entry_points

DEFAULT_PLUGINS_GROUP = "vllm.general_plugins"
logger = logging.getLogger(__name__)
plugins_loaded = False


def load_plugins_by_group(group: str) -> dict:
    allowed = os.environ.get("VLLM_PLUGINS")
    allowed = None if allowed is None else allowed.split(",")
    plugins = {}
    for plugin in entry_points(group=group):
        if allowed is not None and plugin.name not in allowed:
            continue
        try:
            plugins[plugin.name] = plugin.load()
        except Exception:
            logger.exception("Failed to load plugin %s", plugin.name)
    return plugins


def load_general_plugins() -> None:
    global plugins_loaded
    if plugins_loaded:
        return
    plugins_loaded = True
    for func in load_plugins_by_group(DEFAULT_PLUGINS_GROUP).values():
        func()
