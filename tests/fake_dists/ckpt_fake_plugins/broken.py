raise ImportError("fake_broken cannot be imported (on purpose)")
