"""The engine: :class:`CheckpointEngine` and the parts it runs a save and a load with.

Internal: import the engine from :mod:`ckpt_engine`; nothing here is public API.
"""
