"""The engine: target runner, AR and speculative generation loops, proposers, serving."""
