"""The rails of the reference: what keeps a run honest but computes nothing of the model.

    errors          one exception type per kind of failure
    checks          the arrays and settings a model call or a run receives (shapes, ranges, budgets)
    logits          logits that cannot define a distribution (NaN, +inf, all -inf), and kernels' flags
    diagnosis       which layer, weight or cache entry made a forward pass non-finite
    config_checks   every ModelConfig / GenerationConfig field's type and range
    config_io       config.json, diffusiongemma.json and generation_config.json as field values
    checkpoint_io   the converted checkpoint format, and the registry of other formats' readers
    quantized       a Q8_0 matrix kept quantized, and its exact float32 values
    noising_checks  the inputs of the training objective (reference/noising.py)
    replay          recording and replaying a run's draws
    observer        the callback a user passes, and the observer a trace recorder plugs in

Nothing here imports ``variants/``; the specification files import from here only what they call.
"""
