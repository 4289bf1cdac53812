"""The public interface: what other programs may import, and the entry point.

``from ferrus import *`` gives exactly ``__all__``: the store and its state types, the
operations (the one implementation of every behaviour), the config loader and its
dataclasses, the MCP server over stdio, ``main`` and the errors.  Everything else may
change between versions without notice.  Running the file calls ``main()``."""

import gc
import sys

from .startup import STARTED_AS_PROGRAM
from .basics import FerrusError, TransitionError, __version__, realize_dataclasses
from .config import (AgentChoice, AgentOptions, AgentsConfig, CapacityConfig, ChecksConfig,
                     Config, CustomAgentSpec, GitConfig, LeaseConfig, LimitsConfig,
                     NotifyConfig, ParallelConfig, PipelinesConfig, PlaceConfig,
                     SandboxConfig, SessionsConfig, SpecConfig, load_config)
from .task_machine import StateData, TaskState
from .store import Store
from .operations import (Caller, HUMAN, Outcome, op_approve, op_clear_selection,
                         op_create_spec, op_create_task, op_diff, op_human_approve,
                         op_human_reject, op_reject, op_respond_consult, op_review_pending,
                         op_select_milestone, op_stage_task_origin)
from .work import (op_answer, op_ask_human, op_check, op_consult, op_force_reset,
                   op_heartbeat, op_integrated, op_integration_failed, op_release_sessions,
                   op_reset, op_rotate_journal, op_run_checks_only, op_status, op_submit,
                   op_wait_for_answer, op_wait_for_consult, op_wait_for_review,
                   op_wait_for_task)
from .task_queue import (op_cancel_task, op_enqueue_milestone, op_enqueue_ready,
                         op_enqueue_task, op_merged_task_diff, op_retry_task, op_task_diff)
from .graph import (op_graph_context, op_graph_index, op_graph_search, op_graph_show,
                    op_graph_status)
from .memory import (op_memory_rebuild, op_memory_search, op_memory_show, op_memory_status,
                     op_spec_archive)
from .race import op_enqueue_race
from .mcp import serve_stdio
from .cli import main

__all__ = [
    "__version__", "main", "FerrusError", "TransitionError",
    # the config loader and its dataclasses (config)
    "load_config", "Config", "ChecksConfig", "LimitsConfig", "LeaseConfig", "SpecConfig",
    "AgentChoice", "AgentOptions", "CustomAgentSpec", "AgentsConfig", "CapacityConfig",
    "SessionsConfig", "PipelinesConfig", "NotifyConfig", "GitConfig", "ParallelConfig",
    "SandboxConfig", "PlaceConfig",
    # the store and its state types (task_machine, store)
    "Store", "TaskState", "StateData",
    # the operations and what they take and give (operations, work, task_queue, race)
    "Caller", "HUMAN", "Outcome",
    "op_create_task", "op_review_pending", "op_approve", "op_reject", "op_human_approve",
    "op_human_reject", "op_respond_consult", "op_create_spec", "op_select_milestone",
    "op_stage_task_origin", "op_clear_selection", "op_wait_for_task", "op_wait_for_review",
    "op_wait_for_consult", "op_wait_for_answer", "op_check", "op_submit", "op_consult",
    "op_ask_human", "op_answer", "op_status", "op_reset", "op_force_reset",
    "op_rotate_journal", "op_heartbeat", "op_release_sessions", "op_run_checks_only",
    "op_diff", "op_task_diff", "op_merged_task_diff", "op_enqueue_task", "op_enqueue_milestone",
    "op_enqueue_ready", "op_enqueue_race", "op_cancel_task", "op_retry_task",
    "op_integrated", "op_integration_failed",
    # project memory (memory)
    "op_memory_search", "op_memory_show", "op_memory_status", "op_memory_rebuild",
    "op_spec_archive",
    # the repository graph (graph)
    "op_graph_index", "op_graph_status", "op_graph_search", "op_graph_show",
    "op_graph_context",
    # the MCP server over stdio (mcp)
    "serve_stdio",
]


if STARTED_AS_PROGRAM:
    # Loaded (see startup.py): what loading made lives as long as the program, so the
    # collector leaves it out of its later passes, and from now on works as usual.
    gc.freeze()
    gc.enable()
else:
    realize_dataclasses()      # imported: other programs get ordinary dataclasses

if __name__ == "__main__":
    sys.exit(main())
