"""The agent loop: cost model, directions, policies, token-forcing gate, structured memory, rounds."""
