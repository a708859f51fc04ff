"""``ckpt_engine.testing.check_exact_resume``'s parts: the comparison and its report (``compare``),
the processes that train, save and resume (``runs``)."""
