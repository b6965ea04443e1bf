"""Model architectures: the target (Qwen3 / Llama family) and block drafters (DFlash)."""
