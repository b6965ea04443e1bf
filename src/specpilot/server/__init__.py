"""``specpilot serve``: an OpenAI-compatible server of one deployment's found engine.

- :mod:`.lookup`: the deployment's files in a finished run by name and serving regime
  (:func:`~.lookup.run_regimes`, :func:`~.lookup.serving_regime`, :func:`~.lookup.deployment_files`);
- :mod:`.engine`: the engine loaded as ``specpilot run`` loads it and its online scheduler (:class:`~.engine.ServedEngine`),
  the served requests as records (:class:`~.engine.RecordWriter`, ``--record DIR``);
- :mod:`.protocol`: the request bodies and the refusals (one 4xx naming the field);
- :mod:`.text`: incremental detokenization (whole UTF-8 characters) and stop strings;
- :mod:`.app`: the FastAPI app (endpoints, streaming, cancel on disconnect, 429, metrics);
- :mod:`.cli`: the command (uvicorn).
"""
