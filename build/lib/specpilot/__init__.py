"""specpilot: one engine codebase for AR, stock block-drafter and agent-tuned speculative decoding."""

__version__ = "0.1.0"
