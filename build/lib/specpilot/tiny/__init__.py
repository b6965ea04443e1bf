"""The embedded tiny deployment: tokenizer, target and drafter built and trained locally on CPU."""
