"""The ``diffusiongemma`` command: ``generate``, ``convert``, ``trace``, ``compare`` (``main.py``)."""
