"""A plugin that is a module: it records every save result."""

from ckpt_engine import SaveResult, hookimpl

RESULTS: list[SaveResult] = []


@hookimpl
def on_save_done(result: SaveResult) -> None:
    RESULTS.append(result)
