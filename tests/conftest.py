"""Shared pytest set-up for the test package.

The helpers (``tests.hf_tiny``, ``tests.hf_oracle``, ``tests.random_weights``) are imported as modules of
this package, so the repository root must be importable; pytest puts it on ``sys.path`` because ``tests/``
is a package (``tests/__init__.py``).
"""
