"""Integrations of ckpt-engine with training frameworks, each an optional extra.

``ckpt_engine.integrations.lightning`` (``pip install "ckpt-engine[lightning]"``) saves and
resumes PyTorch Lightning training through the engine; ``ckpt_engine.integrations.transformers``
(``pip install "ckpt-engine[transformers]"``) does the same for the Hugging Face ``Trainer``.
Importing this package imports no framework; each integration module imports its framework when
it is imported itself.
"""
