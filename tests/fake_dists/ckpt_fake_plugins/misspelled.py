"""A hookimpl whose name matches no hook: check_pending() must refuse it."""

from ckpt_engine import hookimpl


class Misspelled:
    @hookimpl
    def remap_key(self, ctx, key_map):  # type: ignore[no-untyped-def]  # 'remap_keys' misspelled
        return None
