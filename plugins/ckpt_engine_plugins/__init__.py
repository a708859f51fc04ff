"""Built-in ckpt-engine plugins, registered through the ``ckpt_engine`` entry-point group.

The engine reaches them only through entry points, exactly like third-party plugins.
"""
