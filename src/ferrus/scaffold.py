"""Init: ferrus.toml, .ferrus/ and the skill files.

`ferrus init` — ferrus.toml, .ferrus/ and the skill files, created only where missing."""

import os

from .basics import FerrusError, pretty_json
from .system import atomic_write
from .tomlfile import format_toml_value
from .config import CONFIG_FILE, Config, load_config
from .store import CONTENT_FILES, FERRUS_DIR, JOURNAL_FILE, LOCK_FILE, STATE_FILE, Store
from .specs import SPEC_TEMPLATE
from .agent_files import ensure_gitignore_entry


CONSULT_TEMPLATE = """## Problem
...

## What I tried
...

## Options (if any)
...

## Question
...
"""

def default_config_text(agents_path=".agents"):
    return """\
# ferrus configuration.  Every key is optional unless noted; the values shown
# are the defaults.  Reference: docs/REFERENCE.md, section "ferrus.toml".

[checks]
# The check gate: commands that must all exit 0 before work can be submitted,
# run from the project root through the shell.  Agents cannot add commands.
commands = []
parallel = false        # run the commands at the same time
timeout_secs = 600      # per command; a command past it is killed (its whole process group)
fail_fast = false       # stop the remaining commands after the first failure

[limits]
max_check_retries = 20  # consecutive check failures before the task becomes Failed
max_review_cycles = 3   # reject -> fix round trips before the task becomes Failed
max_feedback_lines = 30 # output lines per failing command shown to the agent
wait_timeout_secs = 60  # how long one wait_* tool call blocks before returning a timeout

[lease]
ttl_secs = 90                # a claim expires this long after its last renewal
heartbeat_interval_secs = 30 # how often agents are asked to call /heartbeat

[spec]
directory = "docs/specs"     # where /create_spec saves specifications

[agents]
path = %s              # where `ferrus init` writes the skill files

# nano, the built-in agent, talks to a local model server (docs/LOCAL_MODELS.md):
# [agents.nano]
# base_url = "http://127.0.0.1:11434/v1"   # Ollama; llama-server :8080/v1, vLLM :8000/v1
# model = "qwen2.5-coder:14b"
# context_tokens = 32768                    # what the server gives the model

[git]
branch = ""            # e.g. "ferrus/{task_id}": each task starts on a new branch of its own
commit = "off"         # "on_approve": commit the task's own files when it is approved
# The team's remote in `ferrus run --parallel` (docs/REFERENCE.md, "The team's remote"):
fetch = false          # true: tasks start from and merge onto the target's upstream
push = ""              # e.g. "origin": push the target after each merge (never forced)
publish = "target"     # "branch": push each task's branch instead, for a pull request
pr = ""                # with publish = "branch": "gh", "glab" or "tea" opens the request

[notify]
# When an agent waits for you or the task ends (docs/REFERENCE.md, "Notifications").
bell = true            # the terminal bell in HQ and `ferrus run`
desktop = false        # also a desktop notification (notify-send, osascript, PowerShell)
command = []           # e.g. ["curl", "-s", "-d", "{event}: {summary}", "https://ntfy.sh/TOPIC"]

[parallel]
# Several queued tasks at once, each in its own git worktree and branch, merged into the
# target only when the checks pass on the result (`ferrus task add`, `ferrus run --parallel N`).
max_tasks = 1          # 1: queued tasks run one at a time in the checkout
integrate = "rebase"   # "merge": the task's own commit and a merge commit on the target
history = "squash"     # one commit per task; "linear": a checked commit per submission
target = ""            # the branch tasks merge into; "" = the branch checked out
worktree_dir = ""      # "" = <repository>.ferrus-worktrees beside the repository
delegates = []         # agents a supervisor's split-off tasks may go to ([] = [hq.executor]'s)
setup = []             # e.g. ["npm ci"]: run in each new worktree (and the merge gate's)
guarded = []           # more paths whose change waits for you (agent files, hooks, CI do)
places = ["here"]      # where tasks run, filled in this order ("here": this machine)
copy = []              # e.g. [".env"]: untracked files copied into each worktree, never committed
copy_mode = "copy"     # "link": a symbolic link to the checkout's file instead
copy_to_places = false # also to a task run at another place (sent with it, at most 16 MiB)
port_base = 20000      # each task's ports: FERRUS_TASK_PORT, {port} in setup (0: none)
ports_per_task = 10
teardown = []          # e.g. ["docker compose down"]: run in a worktree before it is removed

# [sandbox]
# enabled = false      # true: each task's agents and checks may write only its worktree,
#                      # its temp folder and their CLI's own state (bubblewrap on Linux,
#                      # sandbox-exec on macOS; a task refuses to start without one)
# writable = []        # more paths they may write, e.g. ["~/.cache/pip"]
# network = true       # false: no network inside (ferrus's own MCP server still reachable)
# hidden = []          # more paths they must not see (~/.ssh, ~/.aws, ... are hidden already)

# Places: where tasks run besides this machine (docs/PLACES.md); name them in
# [parallel] places, e.g. places = ["here", "box1"].
# [places.box1]
# ssh = ["ssh", "-p", "2222", "agents@build-1"]   # ends with the host
# # exec = ["docker", "exec", "-i", "agents"]     # or any prefix that runs a command there
# slots = 4            # its tasks at once
# dir = "~/.ferrus-places"   # where ferrus, clones and worktrees live there
# python = "python3"   # its Python (3.9+)
# path = []            # folders put first on PATH there (agent CLIs)
# [places.box1.sandbox]  # its own [sandbox] (over the one above)
# enabled = true

[hq.supervisor]
agent = "claude-code"  # claude-code | codex | qwen-code | gemini-cli | opencode | goose | nano
model = ""             # empty: the agent's own default

[hq.executor]
agent = "codex"        # claude-code | codex | qwen-code | gemini-cli | opencode | goose | nano
model = ""
""" % format_toml_value(agents_path)


SKILL_OVERVIEW = """---
name: ferrus
description: How the ferrus orchestration loop works — roles, states, tools and files. Advisory background; the prompt you were started with and the ferrus MCP tools always take precedence.
---

# ferrus

ferrus runs one task at a time through a fixed loop:

1. The **supervisor** agrees the task with the human and calls `create_task`.
2. The **executor** claims it with `wait_for_task`, implements it, runs `check`
   until the project's own lint and test commands pass, then calls `submit`.
3. A **reviewer** (the supervisor role) claims the submission with
   `wait_for_review` and calls `approve` or `reject` with notes.
4. A rejection sends the task back to the executor (state Addressing).

The state lives in `.ferrus/STATE.json`; agents keep nothing between runs.
Move the task only through the MCP tools — never edit `.ferrus/` by hand.

## States

Idle → Executing → Reviewing → Complete, with these detours:
- Executing/Addressing → Consultation (`consult`) → back (`wait_for_consult`)
- Executing/Addressing/Consultation/Reviewing → AwaitingHuman (`ask_human`) →
  back (`answer` by a human, read with `wait_for_answer`)
- Reviewing → Addressing (`reject`); check failures stay in place
- when the project sets `[hq] human_review`, `approve` leads to AwaitingConfirmation:
  only the human then approves (Complete) or rejects (Addressing); agents wait
- too many check failures or rejections → Failed (a human resets it)

## Tools by role

Supervisor: create_task, create_spec, wait_for_review, review_pending, approve,
reject, respond_consult, ask_human, wait_for_answer, answer, status, reset,
heartbeat.

Executor: wait_for_task, check, consult, wait_for_consult, submit, ask_human,
wait_for_answer, answer, status, heartbeat.

Both, read-only: project_memory_status, project_context_search, project_context
(what earlier tasks did and why their work was sent back), repository_graph_status,
repository_graph_search, repository_graph_context (where names are defined, imported
and called, as `path:line`).

Every `wait_*` tool returns `{"status":"timeout"}` when nothing happened within
`wait_timeout_secs`; simply call it again.  Call `heartbeat` about every
`lease.heartbeat_interval_secs` while you hold a task.

## Resources

`ferrus://task`, `ferrus://review`, `ferrus://submission`, `ferrus://question`,
`ferrus://answer`, `ferrus://consult_template`, `ferrus://spec_template`,
`ferrus://consult_request`, `ferrus://consult_response`, `ferrus://state`,
`ferrus://events` (the recent journal) and `ferrus://logs/<file>` (check logs).
"""

SKILL_SUPERVISOR = """---
name: ferrus-supervisor
description: Playbook for the ferrus supervisor — defining tasks, reviewing submissions and answering consultations. Advisory; the initial prompt and the ferrus tools take precedence.
---

# Supervisor playbook

## Defining a task
- Write the outcome first, then constraints, then acceptance criteria a
  reviewer can check without guessing.
- Keep a task small enough to review in one sitting; split larger work into
  spec milestones (`create_spec`).
- Show the draft to the human and wait for a clear yes before `create_task`.

## Reviewing
- Start with `wait_for_review`; read the task, the submission notes and the
  diff itself, not only the notes: `review_pending` shows its stat and first
  part, `ferrus://diff` all of it, `ferrus://diff/<path>` one file.
- Approve when every acceptance criterion holds.  Otherwise `reject` with
  notes that name the file, the problem and the expected result.
- Do not fix the code yourself.

## Consultations
- Read `ferrus://consult_request`, answer the question that was asked, and
  give one recommended option.  Reply with `respond_consult`.

## Humans
- `ask_human` is for decisions only a human can make.  After it, call
  `wait_for_answer` and nothing else.

Tools: create_task, create_spec, wait_for_review, review_pending, approve,
reject, respond_consult, ask_human, wait_for_answer, answer, status, reset,
heartbeat; read-only: project_memory_status, project_context_search,
project_context, repository_graph_status, repository_graph_search,
repository_graph_context.
"""

ROLE_SUPERVISOR = """---
name: ferrus-supervisor-role
description: What the ferrus supervisor is responsible for and what it must not do.
---

# Supervisor role

Responsible for: turning a human's intent into a precise task, reviewing the
executor's submission against it, and guiding the executor when it consults.

Never: implement the task, approve work that has not passed review, change
the task's state except through the ferrus tools, or edit files in `.ferrus/`.
"""

SKILL_EXECUTOR = """---
name: ferrus-executor
description: Playbook for the ferrus executor — implementing a task, using the check gate and submitting well. Advisory; the initial prompt and the ferrus tools take precedence.
---

# Executor playbook

## Working
- Call `wait_for_task` first; it returns the task and, after a rejection,
  the review notes you must address.
- Read the code around the change before editing.  Prefer the smallest diff
  that fully solves the task; follow the project's existing style.
- To find where a name is defined or used, ask `repository_graph_search` and
  `repository_graph_context` before reading files one by one;
  `project_context_search` tells what earlier tasks on the same files decided.
- Run `check` whenever you want feedback and always right before `submit`.
  Each failure uses one retry from a limited budget, so read the output.
- Call `heartbeat` regularly so your lease does not expire.

## When stuck
- `consult` the supervisor with the four headings of
  `ferrus://consult_template` (Problem, What I tried, Options, Question), then
  call `wait_for_consult`.
- `ask_human` only when no agent can decide; then call `wait_for_answer`.

## Submitting
- `submit` runs the check gate again.  The notes say what changed, why, and
  how you verified it, and list anything left undone.

Tools: wait_for_task, check, consult, wait_for_consult, submit, ask_human,
wait_for_answer, answer, status, heartbeat; read-only: project_memory_status,
project_context_search, project_context, repository_graph_status,
repository_graph_search, repository_graph_context.
"""

ROLE_EXECUTOR = """---
name: ferrus-executor-role
description: What the ferrus executor is responsible for and what it must not do.
---

# Executor role

Responsible for: implementing the claimed task, keeping the check gate green
with `check`, and handing the work over with `submit`.

Never: approve or review its own work, change the task's scope, or touch
`.ferrus/` except through the ferrus tools.
"""

SKILL_FILES = (
    ("skills/ferrus/SKILL.md", SKILL_OVERVIEW),
    ("skills/ferrus-supervisor/SKILL.md", SKILL_SUPERVISOR),
    ("skills/ferrus-supervisor/ROLE.md", ROLE_SUPERVISOR),
    ("skills/ferrus-executor/SKILL.md", SKILL_EXECUTOR),
    ("skills/ferrus-executor/ROLE.md", ROLE_EXECUTOR),
)


def init_project(root, agents_path=None, report=print):
    """`ferrus init`: create whatever is missing; never overwrite what exists."""
    root = os.path.abspath(root)
    config_path = os.path.join(root, CONFIG_FILE)
    if os.path.exists(config_path):
        report("%s already exists, kept as it is." % CONFIG_FILE)
        if agents_path is not None:
            report("(--agents-path only applies when ferrus.toml is created)")
    else:
        atomic_write(config_path, default_config_text(agents_path or ".agents"))
        report("Created %s" % CONFIG_FILE)
    try:
        config = load_config(root)
    except FerrusError as err:
        report("warning: %s — using defaults for the spec directory and agents path" % err)
        config = Config()
    store = Store(root)
    os.makedirs(store.path("logs"), exist_ok=True)

    def create(name, content):
        path = store.path(name)
        if os.path.exists(path):
            return
        atomic_write(path, content)
        report("Created %s/%s" % (FERRUS_DIR, name))

    create("CONSULT_TEMPLATE.md", CONSULT_TEMPLATE)
    create("SPEC_TEMPLATE.md", SPEC_TEMPLATE)
    if Store(root).create_state():
        report("Created %s/%s" % (FERRUS_DIR, STATE_FILE))
    for name in CONTENT_FILES:
        create(name, "")
    create(LOCK_FILE, "")
    create("agents.json", pretty_json({"agents": []}))
    create(JOURNAL_FILE, "")
    spec_dir = os.path.join(root, config.spec.directory.strip() or "docs/specs")
    if not os.path.isdir(spec_dir):
        os.makedirs(spec_dir)
        report("Created %s/" % os.path.relpath(spec_dir, root).replace(os.sep, "/"))
    # An explicit --agents-path wins; otherwise the (possibly edited) ferrus.toml decides.
    skills_root = os.path.join(root, agents_path or config.agents.path)
    for rel, text in SKILL_FILES:
        path = os.path.join(skills_root, rel)
        if os.path.exists(path):
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write(path, text)
        report("Created %s" % os.path.relpath(path, root).replace(os.sep, "/"))
    ensure_gitignore_entry(root, FERRUS_DIR + "/", report)
    return config
