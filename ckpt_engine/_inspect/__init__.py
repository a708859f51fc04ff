"""Read-only views of checkpoints that the command line and tests share: reading tables and
values, streaming conversion, dry-run load plans and descriptions of plugins and configuration.

Internal: the command line (:mod:`ckpt_engine.cli`) is its user interface.
"""
