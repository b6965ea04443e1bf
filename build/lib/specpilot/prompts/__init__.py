"""The five benchmark prompt sets: loading, deterministic subsets, prompt formats, prompt files.

Benchmarks and sources: the DFlash harness, dflash/benchmark.py (see shared/notes/anchors.md).
One module per job:

- :mod:`.sources`: where rows come from (the local data dir, ``$SPECPILOT_DATA_DIR``,
  ``shared/data/benchmarks`` beside the repository, or the Hugging Face Hub), the data's checksum,
  :func:`load_rows`. MBPP is the full set's test split (task ids 11..510), not DFlash's
  "sanitized" subset: the local copy holds the full set only.
- :mod:`.formats`: each benchmark's first user turn (gsm8k and math500 append
  ``"\\nPlease reason step by step, and put your final answer within \\\\boxed{}."``; humaneval
  wraps the prompt as ``"Write a solution to the following problem and make sure that it passes
  the tests:\\n```python\\n" + prompt + "\\n```"``; mbpp uses the task text and mt-bench the first
  turn raw) and :func:`format_prompt`, the chat template with ``add_generation_prompt=True`` and
  :data:`CHAT_TEMPLATE_KWARGS` (``enable_thinking=False``); every prompt row records them
  (``chat_template_kwargs``) so that later turns of a conversation are rendered the same way.
- :mod:`.subsets`: :func:`select` (evaluation or calibration prompts, disjoint for every count),
  :func:`calibration_pool` and the fixed reserves, :func:`training_pairs` (the tiny deployment's
  training text, never a test or calibration row).
- :mod:`.files`: :func:`write_prompt_file` (tokenized prompt files, atomically).
- :mod:`.distill`: :func:`distillation_prompts` for the tiny drafters.
- :mod:`.cli`: ``specpilot prompts``.
"""

from .cli import add_arguments, run
from .distill import DISTILL_LONG, DISTILL_MIX, distillation_prompts
from .files import load_tokenizer, write_prompt_file
from .formats import BOXED_SUFFIX, CHAT_TEMPLATE_KWARGS, HUMANEVAL_PREFIX, HUMANEVAL_SUFFIX, format_prompt, user_turns
from .sources import (BENCHMARKS, DATA_DIR_ENV, MBPP_TEST_TASK_IDS, check_data_id, data_checksum, load_rows,
                      repo_data_dir, resolve_data_dir)
from .subsets import (RESERVE_SEED, ROLES, TEST_RESERVE, TRAIN_RESERVE, calibration_pool, select, test_reserve,
                      training_pairs)

__all__ = [
    "BENCHMARKS", "BOXED_SUFFIX", "CHAT_TEMPLATE_KWARGS", "DATA_DIR_ENV", "DISTILL_LONG", "DISTILL_MIX",
    "HUMANEVAL_PREFIX", "HUMANEVAL_SUFFIX", "MBPP_TEST_TASK_IDS", "RESERVE_SEED", "ROLES", "TEST_RESERVE",
    "TRAIN_RESERVE", "add_arguments", "calibration_pool", "check_data_id", "data_checksum", "distillation_prompts",
    "format_prompt", "load_rows", "load_tokenizer", "repo_data_dir", "resolve_data_dir", "run", "select",
    "test_reserve", "training_pairs", "user_turns", "write_prompt_file",
]
