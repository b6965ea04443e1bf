"""Token forcing: every output token of a candidate engine checked by the target itself.

The study's guarantee is that every token a speculative engine emits is the target's own greedy
choice. :func:`force` checks one cell (a candidate's records, the reference records, the prompts
and the target) in four parts; the workflow (``specpilot force``, one verdict file per cell) and
the agents' gate (:meth:`specpilot.agent.trial.Evaluator.gate`) both call it, so a candidate is
rejected by exactly the rule the table reports.

1. **Teacher-forced check** (the guarantee; :mod:`.teacher`). For every candidate request the
   target runs once over prompt + the candidate's own output (one forward; chunked against the KV
   cache when the sequence is longer than ``chunk``). At every output position j, given prompt +
   output[:j]: ``margin = (target's top-1 logit) - (target's logit of the candidate's token)``.
   The token is the target's choice when margin is 0; a **near-tie** when 0 < margin <
   ``tolerance`` (two tokens the target scores almost equally, so a legitimately different kernel
   or batch shape can flip the argmax: counted and reported, with the largest such margin);
   otherwise a **violation** (position, candidate token, target's top-1, margin). Every token is
   checked whatever came before it: a near-tie never hides what follows, and coverage (tokens
   checked / tokens generated) must be 100 % for every request.
   *Which kernels* (:func:`pick_teacher_forced_path`, recorded as the verdict's
   ``teacher_forced_path``): on the CPU, and for engines that did not run the Triton step, the
   target's eager forward (:func:`teacher_forced`, ``"eager"``). When the engine ran the
   bit-invariant Triton step (a dense bf16 target with plain linears on CUDA, chain verification:
   the CUDA-graph fast path of :mod:`specpilot.fastpath`), the pass runs through the *same*
   kernels (:func:`teacher_forced_engine`, ``"triton"``): each prompt prefilled as the engine
   prefills every prompt on that path (row by row through the Triton step, whatever the regime,
   concurrency or arrival order), the output fed through ``FastTarget.forward`` in chunks, in
   batches of :func:`engine_prefill_batches`. The eager bf16 forward (cuBLAS) and the Triton step
   round differently, and on random-weight bf16 targets their top-1 margins differ by up to 0.125
   logits (above the bf16 tolerance), so the eager pass would judge the deployment by a
   computation it never ran.
2. **Structure** of each record's own evidence (:mod:`.structure`): ``len(output_ids) ==
   new_tokens``, ``sum(committed_per_step) == new_tokens - 1`` (the first token comes from
   prefill), ``verify_steps == len(committed_per_step)``, every committed count in 1..the verify
   width of its ``engine_config`` (block size plus tree side branches), ``prompt_tokens`` equal to
   the prompt's length, token ids inside the vocabulary.
3. **Spot re-execution** (:mod:`.reexecute`; the verdict's ``replay`` field and the CLI's
   ``--replay-tokens`` keep their historical names): the verify steps of the first
   ``--replay-tokens`` new tokens of every request are run again with the record's own engine
   config, in the cell's batches (record order, the record's concurrency, the cell's KV-cache
   size). Greedy decoding is deterministic, so the re-run's ``committed_per_step`` and output
   prefix must equal the record's; a record the engine did not produce (AR's output ids with
   invented or copied step counts) fails here. It proves the engine did the recorded work on
   those steps; it cannot prove the later steps' timings.
4. **Reference report** against each reference (AR; stock too for specpilot; :mod:`.reference`):
   the request ids and token counts must match exactly in both directions (a missing, extra,
   short or long request is a violation); the exact-match rate and, per request, where the
   outputs first part (with the teacher-forced classification of the candidate's token there)
   are reported but not judged: part 1 judges every token.

``passed`` = no violation of any part and coverage 100 % for every request (:mod:`.verdict`). The
verdict's fields are listed in docs/forcing.md. The command line: :mod:`.cli`.
"""

from .cli import add_arguments, forcing_kernel_configs, run
from .reexecute import REEXECUTION_TOKENS, Reexecution, reexecution_check, serve_reexecution
from .reference import LISTED, compare_reference
from .structure import structure_problems, verify_width
from .teacher import (CHUNK, DEFAULT_TOLERANCE, TF_BATCH, TF_PATHS, TF_ROWS, engine_prefill_batches,
                      pick_teacher_forced_path, teacher_forced, teacher_forced_engine, tolerance_for)
from .verdict import check, check_engine_config, force, verdict_word

__all__ = [
    "CHUNK", "DEFAULT_TOLERANCE", "LISTED", "REEXECUTION_TOKENS", "TF_BATCH", "TF_PATHS", "TF_ROWS",
    "Reexecution", "add_arguments", "check", "check_engine_config", "compare_reference", "engine_prefill_batches",
    "force", "forcing_kernel_configs", "pick_teacher_forced_path", "reexecution_check", "run", "serve_reexecution",
    "structure_problems", "teacher_forced", "teacher_forced_engine", "tolerance_for", "verdict_word", "verify_width",
]
