"""MCP: ferrus's tools, resources and prompts per role, and the server.

Role scoping is a hard boundary: a tool outside the role is neither listed nor
callable.  Input schemas stay flat; tool failures are isError results with the whole
cause; resources never follow a symbolic link out of .ferrus/."""

import contextlib
import errno
import json
import logging
import os
import re
import signal
import sys
import threading
import time

from .basics import (FerrusError, LazyPattern, UsageError, __version__, compact_json, log,
                     new_id, pretty_json)
from .system import IS_WINDOWS, UnsafePath, atomic_write, open_inside, read_text
from .store import (FERRUS_DIR, JOURNAL_FILE, STATE_FILE, Store, TASKS_DIR, TASK_FILES,
                    TASK_RECORD_FILE, task_record_path)
from .checks import end_active_checks, report_orphaned_checks
from .specs import SPEC_TEMPLATE
from .operations import (Caller, Param, Tool, op_approve, op_create_spec, op_create_task,
                         op_diff, op_reject, op_respond_consult, op_review_pending)
from .work import (op_answer, op_ask_human, op_check, op_consult, op_heartbeat, op_reset,
                   op_status, op_submit, op_wait_for_answer, op_wait_for_consult,
                   op_wait_for_review, op_wait_for_task)
from .task_queue import _TASK_ID_RE, op_enqueue_task
from .graph import GRAPH_TOOLS
from .memory import MEMORY_TOOLS
from .jsonrpc import (INTERNAL_ERROR, INVALID_PARAMS, INVALID_REQUEST, JsonRpcServer,
                      LOG_LEVELS, MCP_ALL_VERSIONS, MCP_LEGACY_VERSIONS,
                      MCP_MODERN_VERSIONS, META_CLIENT_CAPABILITIES, META_LOG_LEVEL,
                      META_SERVER_INFO, META_VERSION, METHOD_NOT_FOUND, REMOVED_IN_MODERN,
                      RESOURCE_NOT_FOUND, RpcError, UNSUPPORTED_PROTOCOL_VERSION,
                      _current_request, _valid_id)


# -- ferrus tools ---------------------------------------------------------------------

SUP, EXE = ("supervisor",), ("executor",)
BOTH = ("supervisor", "executor")
_TEXT_OUT = {"message": "string", "state": "string"}
_CLAIM_OUT = {"status": "string", "state": "string", "claimed_by": "string?",
              "lease_until": "string?", "task": "string", "review": "string", "task_id": "string?",
              "heartbeat_interval_secs": "integer?"}

TOOLS = (
    Tool("create_task", "Create task",
         "Start a new task from Idle: writes the description to TASK.md and moves the state to "
         "Executing so an executor can claim it with /wait_for_task. Confirm the task with the "
         "user first.", SUP,
         lambda st, c, description: op_create_task(st, c, description),
         (Param("description", "string", "The whole task in Markdown: outcome, constraints, "
                                         "acceptance criteria."),),
         dict(_TEXT_OUT, task_id="string", base="object", warnings="array")),
    Tool("enqueue_task", "Queue task",
         "Put a task in the queue that `ferrus run` and HQ work through (several at once, each "
         "in its own git worktree, with [parallel] max_tasks above 1). Use it to split a "
         "milestone into independent tasks as team lead: each should change different files. "
         "Confirm the tasks with the user first.", SUP,
         lambda st, c, description, spec=None, milestone=None, agent=None: op_enqueue_task(
             st, c, description, spec, milestone, agent),
         (Param("description", "string", "The whole task in Markdown: outcome, constraints, "
                                         "acceptance criteria."),
          Param("spec", "string", "Optional: the spec (path relative to the project) whose "
                                  "milestone this task implements.", required=False),
          Param("milestone", "string", "Optional: that milestone's ID.", required=False),
          Param("agent", "string", "Optional: the executor agent to hand it to (e.g. "
                                   "claude-code, codex); [parallel] delegates says which may "
                                   "be used.", required=False)),
         dict(_TEXT_OUT, task_id="string", title="string")),
    Tool("create_spec", "Create spec",
         "Save an approved feature specification (Markdown following ferrus://spec_template) "
         "into the spec directory and select its first ready milestone when no task is running.",
         SUP, lambda st, c, markdown: op_create_spec(st, c, markdown),
         (Param("markdown", "string", "The full specification in Markdown."),),
         dict(_TEXT_OUT, path="string", selected_milestone="string?")),
    Tool("wait_for_review", "Wait for review",
         "Block until a submission is in Reviewing, claim the review lease and return the task, "
         "submission notes, earlier review notes, the task's diff (stat and first part; "
         "ferrus://diff has all of it) and the changed files (the first 500; "
         "changed_files_total counts them all). On {\"status\":\"timeout\"} call it again.",
         SUP, lambda st, c: op_wait_for_review(st, c), (),
         dict(_CLAIM_OUT, submission="string", review_cycles_used="integer",
              check_retries_used="integer", diff="string", changed_files="array",
              changed_files_total="integer")),
    Tool("review_pending", "Review pending submission",
         "Read the task, the submission notes, the task's diff (stat and first part) and "
         "previous review notes of the submission awaiting review.", SUP, lambda st, c: op_review_pending(st, c), (), _TEXT_OUT,
         read_only=True, idempotent=True),
    Tool("approve", "Approve submission",
         "Accept the submission under review: the state becomes Complete and the task's spec "
         "milestone is ticked (with [hq] human_review on, it becomes AwaitingConfirmation "
         "until the human confirms).", SUP,
         lambda st, c, notes=None: op_approve(st, c, notes),
         (Param("notes", "string", "Optional: what you verified and why it is acceptable "
                                   "(shown to the human who confirms).", required=False),),
         _TEXT_OUT),
    Tool("reject", "Reject submission",
         "Send the submission back with notes saying exactly what must change. The state "
         "becomes Addressing (or Failed once max_review_cycles is reached).", SUP,
         lambda st, c, notes: op_reject(st, c, notes),
         (Param("notes", "string", "Concrete, actionable review notes in Markdown."),),
         dict(_TEXT_OUT, review_cycles="integer"), destructive=True),
    Tool("respond_consult", "Answer consultation",
         "Answer the executor's consultation request (ferrus://consult_request). The executor "
         "receives it from /wait_for_consult.", SUP,
         lambda st, c, response: op_respond_consult(st, c, response),
         (Param("response", "string", "Your guidance for the executor."),), _TEXT_OUT),
    Tool("wait_for_task", "Wait for task",
         "Block until a task is in Executing or Addressing, claim its lease and return the task "
         "and any review notes to address. On {\"status\":\"timeout\"} call it again.", EXE,
         lambda st, c: op_wait_for_task(st, c), (), _CLAIM_OUT),
    Tool("check", "Run checks",
         "Run the project's configured check commands (lint, tests). Passing resets the retry "
         "counter; each failure uses one retry and returns the failing output. Use it freely "
         "while working and again just before /submit.", EXE,
         lambda st, c: op_check(st, c), (),
         dict(_TEXT_OUT, passed="boolean", log="string?", check_retries="integer")),
    Tool("consult", "Consult supervisor",
         "Pause the task and ask the supervisor for guidance. The question must use the four "
         "headings of ferrus://consult_template. Then call /wait_for_consult.", EXE,
         lambda st, c, question: op_consult(st, c, question),
         (Param("question", "string", "The filled-in consultation template."),),
         dict(_TEXT_OUT, paused_state="string")),
    Tool("submit", "Submit for review",
         "Run the final check gate and, when it passes, record the submission notes and move "
         "the task to Reviewing.", EXE,
         lambda st, c, content: op_submit(st, c, content),
         (Param("content", "string", "Submission notes: what changed, why, and how it was "
                                     "verified."),),
         dict(_TEXT_OUT, passed="boolean", log="string?", check_retries="integer")),
    Tool("wait_for_consult", "Wait for consultation",
         "Block until the supervisor answers your consultation, then resume the paused state "
         "and return the answer. On {\"status\":\"timeout\"} call it again.", EXE,
         lambda st, c: op_wait_for_consult(st, c), (),
         {"status": "string", "state": "string", "response": "string", "message": "string"}),
    Tool("wait_for_answer", "Wait for human answer",
         "Block until a human answers the question you asked with /ask_human, then return the "
         "answer and the state the task resumed in. On {\"status\":\"timeout\"} call it again.",
         BOTH, lambda st, c: op_wait_for_answer(st, c), (),
         {"status": "string", "state": "string", "answer": "string", "resumed_state": "string"}),
    Tool("ask_human", "Ask a human",
         "Last resort when only a human can decide: pause the task with a question. Call "
         "/wait_for_answer right after and nothing else.", BOTH,
         lambda st, c, question: op_ask_human(st, c, question),
         (Param("question", "string", "A short, self-contained question for the human."),),
         dict(_TEXT_OUT, paused_state="string")),
    Tool("answer", "Answer question",
         "Answer the pending human question (ferrus://question) and resume the paused state.",
         BOTH, lambda st, c, response: op_answer(st, c, response),
         (Param("response", "string", "The answer."),), _TEXT_OUT),
    Tool("status", "Status",
         "Show the task state, retry and review counters, the lease and the selected milestone.",
         BOTH, lambda st, c: op_status(st, c), (),
         {"state": "string", "task_id": "string?", "check_retries": "integer",
          "review_cycles": "integer", "failure_reason": "string?", "paused_state": "string?",
          "claimed_by": "string?", "lease_until": "string?", "state_entered_at": "string?",
          "seconds_in_state": "number?", "task_started_at": "string?",
          "selected_spec": "string?", "selected_milestone": "string?", "rev": "integer",
          "capacity": "object?", "message": "string?"},
         read_only=True, idempotent=True),
    Tool("reset", "Reset failed task",
         "Escape hatch after the task Failed: return to Idle, clearing review, submission and "
         "consultation files.", SUP, lambda st, c: op_reset(st, c), (), _TEXT_OUT,
         destructive=True),
    Tool("heartbeat", "Renew lease",
         "Renew this agent's lease on the task; call it every lease.heartbeat_interval_secs "
         "while working. The lease is always this server's own identity.", BOTH,
         lambda st, c, agent_id=None: op_heartbeat(st, c, agent_id),
         (Param("agent_id", "string", "Optional; if given it must be this server's own agent "
                                      "id.", required=False),),
         {"status": "string", "claimed_by": "string?", "lease_until": "string?",
          "code": "string", "message": "string"}, idempotent=True),
) + MEMORY_TOOLS + GRAPH_TOOLS   # read-only, every role, after the task tools (fixed order)
TOOLS_BY_NAME = {tool.name: tool for tool in TOOLS}


def tools_for_role(role):
    """The tools a server for ``role`` offers (every tool when role is None)."""
    return [tool for tool in TOOLS if role is None or role in tool.roles]


# -- resources and prompts --------------------------------------------------------------

# uri name, title, file, mime type, what a missing file gives (None: an error).
RESOURCES = (
    ("task", "Task", "TASK.md", "text/markdown", None),
    ("review", "Review Notes", "REVIEW.md", "text/markdown", None),
    ("submission", "Submission", "SUBMISSION.md", "text/markdown", None),
    ("question", "Question", "QUESTION.md", "text/markdown", ""),
    ("answer", "Answer", "ANSWER.md", "text/markdown", ""),
    ("consult_template", "Consultation Template", "CONSULT_TEMPLATE.md", "text/markdown", ""),
    ("spec_template", "Specification Template", "SPEC_TEMPLATE.md", "text/markdown", "SPEC"),
    ("consult_request", "Consult Request", "CONSULT_REQUEST.md", "text/markdown", None),
    ("consult_response", "Consult Response", "CONSULT_RESPONSE.md", "text/markdown", None),
    ("state", "State", STATE_FILE, "application/json", None),
    ("events", "Recent Events", JOURNAL_FILE, "application/json", "[]"),
)
RESOURCES_BY_NAME = {entry[0]: entry for entry in RESOURCES}
EVENTS_RESOURCE_LIMIT = 200
# A .ferrus/ file served whole up to this size; past it the tail is left out (and said so).
RESOURCE_MAX_BYTES = 4 * 1024 * 1024
# ferrus://logs/{name}: a log up to HEAD + TAIL bytes is served whole, a longer one as
# its first HEAD and last TAIL bytes; ?offset=&length= reads any range up to READ_MAX.
LOG_WINDOW_HEAD = 16 * 1024
LOG_WINDOW_TAIL = 240 * 1024
LOG_READ_MAX = 1024 * 1024
LOG_URI_RE = LazyPattern(r"^ferrus://logs/([A-Za-z0-9_][A-Za-z0-9_.-]*)"
                        r"(?:\?(offset=\d{1,18}(?:&length=\d{1,18})?|length=\d{1,18}))?$")

PROMPTS = (
    ("executor-context", "Executor task context: state, task, and review notes",
     "Executor task context: state, task description, and review notes"),
    ("supervisor-review", "Supervisor review context: state, task, and submission notes",
     "Supervisor review context: state, task description, and submission notes"),
)


class ResourceNotFound(FerrusError):
    """A ferrus:// URI that names nothing ferrus will serve."""


def open_in_ferrus_dir(store, *parts):
    """An open binary file object for .ferrus/<parts> (see open_inside): raises
    ResourceNotFound for what ferrus refuses to read, or OSError.  A task's own files
    (STATE.json, TASK.md, ...) are those of the store's task."""
    base = store.task_dir if len(parts) == 1 and parts[0] in TASK_FILES else store.path()
    try:
        return open_inside(base, *parts)
    except UnsafePath as err:
        raise ResourceNotFound(err.message, err.hint) from err


def read_ferrus_text(store, name, limit=RESOURCE_MAX_BYTES):
    """The text of .ferrus/<name> (symlink-safe), at most ``limit`` bytes of it."""
    with open_in_ferrus_dir(store, name) as handle:
        data = handle.read(limit + 1)
    text = data[:limit].decode("utf-8", errors="replace")
    if len(data) > limit:
        text += ("\n\n[ferrus: %s/%s is larger than %d bytes; the rest is left out]\n"
                 % (FERRUS_DIR, name, limit))
    return text


def _utf8_start(data, index):
    """``index`` moved forward past UTF-8 continuation bytes (at most 3)."""
    for _ in range(3):
        if index < len(data) and 0x80 <= data[index] < 0xC0:
            index += 1
    return index


def _utf8_text(data):
    """``data`` as text when it is UTF-8 without NUL bytes (a cut last character
    is dropped), else None: such content is sent as a blob."""
    if b"\0" in data:
        return None
    for cut in range(4):
        try:
            return data[:len(data) - cut].decode("utf-8")
        except UnicodeDecodeError as err:
            if err.start < len(data) - 4:
                return None
    return None


def read_log_window(store, uri):
    """(contents list) of ferrus://logs/<name>[?offset=N&length=M], never the whole
    of a huge log: see LOG_WINDOW_HEAD/TAIL and LOG_READ_MAX."""
    import base64
    match = LOG_URI_RE.match(uri)
    if not match:
        raise ResourceNotFound("Resource not found: %s" % uri,
                               "log URIs are ferrus://logs/<file name in .ferrus/logs>, "
                               "optionally with ?offset=<byte>&length=<bytes>")
    name, query = match.group(1), match.group(2)
    base_uri = "ferrus://logs/" + name
    try:
        handle = open_in_ferrus_dir(store, "logs", name)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        raise ResourceNotFound("Resource not found: %s" % uri,
                               "the log may have been removed; a check run writes new ones"
                               ) from None
    with handle:
        size = os.fstat(handle.fileno()).st_size
        if query:
            fields = dict(part.split("=") for part in query.split("&"))
            offset = min(int(fields.get("offset", 0)), size)
            length = min(int(fields.get("length", LOG_READ_MAX)), LOG_READ_MAX)
            handle.seek(offset)
            pieces = [(offset, handle.read(length))]
        elif size <= LOG_WINDOW_HEAD + LOG_WINDOW_TAIL:
            pieces = [(0, handle.read(size))]
        else:
            head = handle.read(LOG_WINDOW_HEAD)
            handle.seek(size - LOG_WINDOW_TAIL)
            tail = handle.read(LOG_WINDOW_TAIL)
            skip = _utf8_start(tail, 0)
            pieces = [(0, head), (size - LOG_WINDOW_TAIL + skip, tail[skip:])]
    end = pieces[-1][0] + len(pieces[-1][1])
    texts = [_utf8_text(data) for _, data in pieces]
    if len(pieces) == 2:
        gap_start = len(pieces[0][1])
        note = ("[ferrus: this log has %d bytes; bytes %d to %d (%d bytes) are left out. "
                "Read them with %s?offset=%d&length=%d (at most %d bytes per read).]"
                % (size, gap_start, pieces[1][0], pieces[1][0] - gap_start, base_uri,
                   gap_start, min(pieces[1][0] - gap_start, LOG_READ_MAX), LOG_READ_MAX))
    elif query and (pieces[0][0] > 0 or end < size):
        note = ("[ferrus: bytes %d to %d of %d]" % (pieces[0][0], end, size))
    else:
        note = None
    if all(text is not None for text in texts):
        if len(texts) == 2:
            text = "%s\n\n%s\n\n%s" % (texts[0], note, texts[1])
        else:
            text = texts[0] if note is None else "%s\n%s" % (note, texts[0])
        return [{"uri": uri, "mimeType": "text/plain", "text": text}]
    # Binary (NUL bytes or not UTF-8): the bytes as they are, base64 in blobs.
    contents = []
    if note:
        contents.append({"uri": uri, "mimeType": "text/plain", "text": note})
    for offset, data in pieces:
        contents.append({"uri": "%s?offset=%d&length=%d" % (base_uri, offset, len(data)),
                         "mimeType": "application/octet-stream",
                         "blob": base64.b64encode(data).decode("ascii")})
    return contents


def read_diff_resource(store, uri):
    """The text of ferrus://diff (the task's whole diff, bounded) or ferrus://diff/<path>
    (one file or folder of it).  Without git it says why there is no diff."""
    import urllib.parse
    rest = uri[len("ferrus://diff"):]
    paths = None
    if rest:
        path = urllib.parse.unquote(rest[1:]) if rest.startswith("/") else ""
        parts = path.replace("\\", "/").split("/")
        if (not path or "\0" in path or path.startswith("/") or re.match(r"^[A-Za-z]:", path)
                or ".." in parts):
            raise ResourceNotFound("Resource not found: %s" % uri,
                                   "diff URIs are ferrus://diff or ferrus://diff/<path relative "
                                   "to the project root>")
        paths = [path.rstrip("/")]
    return op_diff(store, paths=paths).text


def read_resource(store, uri):
    """(mime type, text) of a ``ferrus://`` resource; nothing outside .ferrus/ is reachable.

    Raises ResourceNotFound for a URI that names nothing (or a file that is
    missing or refused), OSError when reading fails."""
    if not isinstance(uri, str) or not uri.startswith("ferrus://"):
        raise ResourceNotFound("Resource not found: %s" % uri)
    name = uri[len("ferrus://"):]
    if name == "diff" or name.startswith("diff/"):
        return "text/x-diff", read_diff_resource(store, uri)
    if name.startswith("logs/"):
        contents = read_log_window(store, uri)
        return contents[0]["mimeType"], "".join(c.get("text", "") for c in contents)
    entry = RESOURCES_BY_NAME.get(name)
    if entry is None:
        raise ResourceNotFound("Unknown ferrus resource: %s" % name,
                               "resources/list names every resource ferrus serves")
    _, _, filename, mime, missing = entry
    try:
        if name in ("events", "state"):
            # Parsed by the store; opening first refuses a symlink in their place.
            open_in_ferrus_dir(store, filename).close()
            if name == "events":
                return mime, pretty_json(store.read_journal(limit=EVENTS_RESOURCE_LIMIT))
            return mime, store.read_state().to_json()
        return mime, read_ferrus_text(store, filename)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        if missing is None:
            raise ResourceNotFound("Resource not found: %s (.ferrus/%s does not exist)"
                                   % (uri, filename)) from None
        return mime, SPEC_TEMPLATE if missing == "SPEC" else missing


def render_prompt(store, name):
    data = store.read_state()

    def read(filename):
        try:
            return read_ferrus_text(store, filename)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return ""
        except ResourceNotFound as err:   # a symlink out of .ferrus/: say so, show nothing
            return "[ferrus: %s]" % err.message
    task = read("TASK.md")
    if name == "executor-context":
        sections = ["## State\n\nCurrent state: **%s** | Check retries: %d | Review cycles: %d"
                    % (data.state, data.check_retries, data.review_cycles), "## Task\n\n" + task]
        review = read("REVIEW.md")
        if review.strip():
            sections.append("## Review Notes (Re-address)\n\n" + review)
    else:
        sections = ["## State\n\nCurrent state: **%s** | Check retries used: %d | Review cycles: %d"
                    % (data.state, data.check_retries, data.review_cycles), "## Task\n\n" + task]
        submission = read("SUBMISSION.md")
        if submission.strip():
            sections.append("## Submission Notes\n\n" + submission)
    return "\n\n---\n\n".join(sections)


# -- the ferrus MCP server ------------------------------------------------------------------

# Names the agent session a `ferrus serve` works for.  HQ sets it for every agent it
# starts; the agent's MCP server inherits it and leases carry it, so two copies of one
# <role>:<agent>:<index> can never both hold or renew a lease.
SESSION_ENV = "FERRUS_SESSION"
_SESSION_RE = LazyPattern(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def agent_identity(role, agent_name, index, session=None):
    """``<role>:<agent>:<index>`` (upstream's agent id), plus ``/<session>`` when the
    server works for one known agent session."""
    identity = "%s:%s:%s" % (role or "agent", agent_name, index)
    return identity + "/" + session if session else identity


def session_from_environment(value=None):
    """The agent session named by --session or $FERRUS_SESSION (None when unset)."""
    value = os.environ.get(SESSION_ENV, "") if value is None else value
    if not value:
        return None
    if not _SESSION_RE.match(value):
        raise UsageError("the agent session %r is not a valid id" % value[:80],
                         "use letters, digits, '.', '_' and '-' (at most 64), as HQ does")
    return value


def session_id_for_task(task):
    """A new agent session id for an agent of parallel task ``task``.  The session id is
    what reaches the agent's MCP server with every agent CLI (FERRUS_SESSION, see
    Launch), so naming the task in it tells the server its task at launch, with
    nothing to register per task."""
    return "%s.%s" % (task, new_id("s"))


def session_task(session):
    """The parallel task an agent session works for (None for the project's own)."""
    task, dot, rest = (session or "").partition(".")
    return task if dot and _TASK_ID_RE.match(task) and rest.startswith("s-") else None


class FerrusMcpServer:
    """The ferrus tools, resources and prompts for one role, on a JsonRpcServer.

    Every answer is shaped for the protocol version in force for its request
    (``era``): the one negotiated by initialize, or 2026-07-28 for a request
    whose ``_meta`` carries a protocol version.  Fields a version does not
    define are left out for it."""

    PAGE_SIZE = 100

    def __init__(self, store, role=None, agent_name="unknown", agent_index=0,
                 reader=None, writer=None, session=None):
        self.store = store
        self.role = role
        self.agent_id = agent_identity(role, agent_name, agent_index, session)
        self.rpc = JsonRpcServer(reader, writer)
        self.tools = tools_for_role(role)
        self.tool_names = {tool.name for tool in self.tools}
        self.initialized = False
        self.protocol_version = None
        self.log_level = "info"
        self.tool_calls = 0
        self.usage = ToolCallCounter(agent_name=self.agent_id)
        rpc = self.rpc
        rpc.handlers.update({
            "initialize": self._initialize,
            "server/discover": self._discover,
            "ping": self._guard(lambda request: {}),
            "tools/list": self._guard(self._tools_list),
            "tools/call": self._guard(self._tools_call),
            "resources/list": self._guard(self._resources_list),
            "resources/templates/list": self._guard(self._templates_list),
            "resources/read": self._guard(self._resources_read),
            "prompts/list": self._guard(self._prompts_list),
            "prompts/get": self._guard(self._prompts_get),
            "logging/setLevel": self._guard(self._set_level),
        })
        rpc.lane_of = self._lane_of
        rpc.busy = self._busy
        rpc.notification_handlers.update({
            "notifications/initialized": lambda params: None,
            "notifications/cancelled": self._cancelled,
        })
        self._log_handler = _McpLogHandler(self)

    def serve(self):
        # The server's own warnings and errors also go to the client (notifications/message).
        log.addHandler(self._log_handler)
        try:
            self.rpc.serve_forever()
        finally:
            log.removeHandler(self._log_handler)

    # -- protocol ----------------------------------------------------------------------

    def era(self, request):
        """The protocol version a request is answered under."""
        if request is not None and request.modern:
            return MCP_MODERN_VERSIONS[0]
        return self.protocol_version or MCP_LEGACY_VERSIONS[0]

    def server_info(self, version=None):
        info = {"name": "ferrus", "version": __version__}
        if version is None or version >= "2025-06-18":
            info["title"] = "ferrus (%s)" % (self.role or "all tools")
        return info

    def capabilities(self):
        return {"tools": {"listChanged": False},
                "resources": {"listChanged": False, "subscribe": False},
                "prompts": {"listChanged": False}, "logging": {}}

    def instructions(self):
        if self.role == "executor":
            return ("ferrus executor tools. Start with /wait_for_task, implement the task, run "
                    "/check, then /submit. Call /heartbeat while you work.")
        if self.role == "supervisor":
            return ("ferrus supervisor tools: define tasks (/create_task), review submissions "
                    "(/wait_for_review, /approve, /reject) and answer consultations.")
        return "ferrus: every orchestration tool (no role restriction)."

    def _initialize(self, request):
        if META_VERSION in request.meta:
            raise RpcError(METHOD_NOT_FOUND, "Method not found: initialize does not exist in "
                           "protocol version 2026-07-28 (use server/discover)")
        if request.batched:
            raise RpcError(INVALID_REQUEST, "initialize must not be part of a JSON-RPC batch")
        requested = request.params.get("protocolVersion")
        if not isinstance(requested, str):
            raise RpcError(INVALID_PARAMS, "initialize needs protocolVersion as a string, e.g. "
                                           "\"%s\"" % MCP_LEGACY_VERSIONS[0])
        version = requested if requested in MCP_LEGACY_VERSIONS else MCP_LEGACY_VERSIONS[0]
        self.protocol_version = self.rpc.protocol_version = version
        self.initialized = True
        return {"protocolVersion": version, "capabilities": self.capabilities(),
                "serverInfo": self.server_info(version), "instructions": self.instructions()}

    def _check_modern_meta(self, request):
        """Validate a 2026-07-28 request's _meta: -32022 for a version ferrus does
        not speak (listing every one it does), -32602 for a missing field."""
        meta = request.meta
        if META_VERSION not in meta:
            raise RpcError(INVALID_PARAMS, "%s needs _meta[\"%s\"] (one of %s)" % (
                request.method, META_VERSION, ", ".join(MCP_MODERN_VERSIONS)))
        version = meta[META_VERSION]
        if version not in MCP_MODERN_VERSIONS:
            raise RpcError(UNSUPPORTED_PROTOCOL_VERSION,
                           "Unsupported protocol version: %s" % (version,),
                           {"supported": list(MCP_ALL_VERSIONS),
                            "requested": version if isinstance(version, str) else
                            json.dumps(version)})
        if not isinstance(meta.get(META_CLIENT_CAPABILITIES), dict):
            raise RpcError(INVALID_PARAMS, "_meta must carry %s (an object)"
                           % META_CLIENT_CAPABILITIES)
        level = meta.get(META_LOG_LEVEL)
        if level is not None and level not in LOG_LEVELS:
            raise RpcError(INVALID_PARAMS, "Invalid %s %r; expected one of %s"
                           % (META_LOG_LEVEL, level, ", ".join(LOG_LEVELS)))
        request.modern = True

    def _discover(self, request):
        self._check_modern_meta(request)
        return {"resultType": "complete", "supportedVersions": list(MCP_ALL_VERSIONS),
                "capabilities": self.capabilities(), "instructions": self.instructions(),
                "ttlMs": 0, "cacheScope": "private",
                "_meta": {META_SERVER_INFO: self.server_info()}}

    def _guard(self, handler):
        """Legacy requests need initialize first; modern ones carry their version in _meta."""
        def guarded(request):
            if META_VERSION in request.meta:
                if request.method in REMOVED_IN_MODERN:
                    raise RpcError(METHOD_NOT_FOUND, "Method not found: %s does not exist in "
                                   "protocol version 2026-07-28" % request.method)
                self._check_modern_meta(request)
                result = handler(request)
                result.setdefault("resultType", "complete")
                result.setdefault("_meta", {})[META_SERVER_INFO] = self.server_info()
                return result
            if not self.initialized and request.method != "ping":
                raise RpcError(INVALID_REQUEST, "Server not initialized: send initialize first")
            return handler(request)
        return guarded

    def _lane_of(self, request):
        if request.method == "resources/read":
            # The task's diff runs git, which can take a while in a big repository.
            uri = request.params.get("uri")
            return "blocking" if isinstance(uri, str) and uri.startswith("ferrus://diff") \
                else None
        if request.method != "tools/call":
            return None
        name = request.params.get("name")
        return "blocking" if isinstance(name, str) and name in BLOCKING_TOOLS else "quick"

    def _busy(self, request, lane):
        """The answer to a call no worker can take: a tool error the caller can read."""
        if request.method != "tools/call":
            return self.rpc._default_busy(request, lane)
        text = ("ferrus: too many calls in flight: %d %s tool calls are already running on "
                "this server, the most it runs at once.\nhint: wait for one of them to "
                "finish (or cancel it) and call %s again"
                % (lane.active, lane.name, request.params.get("name")))
        return self._error_result(text)

    def _structured(self, request):
        return self.era(request) >= "2025-06-18"

    def _page(self, request, items, key):
        import base64
        cursor = request.params.get("cursor")
        start = 0
        if cursor is not None:
            try:
                start = int(base64.b64decode(str(cursor).encode("ascii"), validate=True))
                if start < 0 or start > len(items):
                    raise ValueError
            except (ValueError, TypeError, UnicodeError):
                raise RpcError(INVALID_PARAMS, "Invalid cursor: %r" % (cursor,)) from None
        page = items[start:start + self.PAGE_SIZE]
        result = {key: page}
        if start + self.PAGE_SIZE < len(items):
            result["nextCursor"] = base64.b64encode(
                str(start + self.PAGE_SIZE).encode("ascii")).decode("ascii")
        if request.modern:
            result.update(ttlMs=0, cacheScope="private")
        return result

    def _cancelled(self, params):
        request_id = params.get("requestId")
        if _valid_id(request_id):
            self.rpc.cancel(request_id)

    def _set_level(self, request):
        level = request.params.get("level")
        if level not in LOG_LEVELS:
            raise RpcError(INVALID_PARAMS, "Invalid log level %r; expected one of %s"
                           % (level, ", ".join(LOG_LEVELS)))
        self.log_level = level
        return {}

    def send_log(self, level, message, request=None):
        """notifications/message at or above the client's level.

        A 2026-07-28 request chooses its own level in _meta (no level: no log
        messages for it); otherwise the level set by logging/setLevel applies,
        once the client has initialized."""
        if request is not None and request.modern:
            threshold = request.meta.get(META_LOG_LEVEL)
            if threshold not in LOG_LEVELS:
                return
        elif self.initialized:
            threshold = self.log_level
        else:
            return
        if LOG_LEVELS.index(level) >= LOG_LEVELS.index(threshold):
            self.rpc.notify("notifications/message",
                            {"level": level, "logger": "ferrus", "data": message})

    # -- tools -------------------------------------------------------------------------

    def _tools_list(self, request):
        version = self.era(request)
        items = []
        for tool in self.tools:
            entry = {"name": tool.name}
            if version >= "2025-06-18":
                entry["title"] = tool.title
            entry.update(description=tool.description, inputSchema=tool.input_schema())
            if version >= "2025-03-26":
                entry["annotations"] = {"title": tool.title, "readOnlyHint": tool.read_only,
                                        "destructiveHint": tool.destructive,
                                        "idempotentHint": tool.idempotent,
                                        "openWorldHint": False}
            if version >= "2025-06-18":
                entry["outputSchema"] = tool.output_schema()
            items.append(entry)
        return self._page(request, items, "tools")

    @staticmethod
    def _error_result(text):
        return {"content": [{"type": "text", "text": text}], "isError": True}

    def _tools_call(self, request):
        name = request.params.get("name")
        if not isinstance(name, str) or name not in self.tool_names:
            # A tool outside this role is as unknown as a tool that does not exist.
            raise RpcError(INVALID_PARAMS, "Unknown tool: %s" % (name,))
        tool = TOOLS_BY_NAME[name]
        arguments = request.params.get("arguments")
        arguments = {} if arguments is None else arguments
        if not isinstance(arguments, dict):
            raise RpcError(INVALID_PARAMS, "arguments of %s must be an object" % name)
        problem = _argument_problem(tool, arguments)
        if problem is not None:
            # 2025-11-25 (SEP-1303): input validation errors are tool execution
            # errors the model can read and correct; earlier versions list
            # invalid arguments among the protocol errors.
            if self.era(request) >= "2025-11-25":
                return self._error_result("ferrus: %s\nhint: %s" % problem)
            raise RpcError(INVALID_PARAMS, problem[0])
        caller = Caller(self.role or "agent", self.agent_id, request.cancel,
                        self._progress_reporter(request))
        self.tool_calls += 1
        with contextlib.suppress(FerrusError, OSError):
            self.usage.count(self.store)
        try:
            outcome = tool.run(self.store, caller, **arguments)
        except FerrusError as err:
            return self._error_result(err.full_text())
        except OSError as err:
            # A full disk, a read-only file system, a name too long...: the tool
            # failed, the state on disk did not change (transactions are atomic).
            return self._error_result(os_error_text(tool.name, err))
        failed = outcome.data.get("status") == "error" or outcome.data.get("passed") is False
        content = [{"type": "text", "text": outcome.text}]
        result = {"content": content, "isError": failed}
        if self._structured(request):
            result["structuredContent"] = outcome.data
            # The text blocks must carry the structured JSON too (the tools page's
            # SHOULD); prose, when there is any, stays first for human readers.
            mirror = compact_json(outcome.data)
            if outcome.text != mirror:
                content.append({"type": "text", "text": mirror})
        return result

    def _progress_reporter(self, request):
        token = request.meta.get("progressToken")
        if not (_valid_id(token)):
            return None
        count = [0]
        with_message = self.era(request) >= "2025-03-26"

        def report(message):
            if request.cancel.is_set():
                return
            count[0] += 1
            params = {"progressToken": token, "progress": count[0]}
            if with_message:
                params["message"] = message
            self.rpc.notify("notifications/progress", params)
        return report

    # -- resources and prompts ---------------------------------------------------------

    def _resources_list(self, request):
        items = [{"uri": "ferrus://" + name, "name": title, "mimeType": mime}
                 for name, title, _, mime, _ in RESOURCES]
        items.append({"uri": "ferrus://diff", "name": "Task Diff", "mimeType": "text/x-diff",
                      "description": "The task's changes from its base commit to the working "
                                     "tree (untracked files included): a stat, then the "
                                     "unified diff, its middle left out when it is long"})
        return self._page(request, items, "resources")

    def _templates_list(self, request):
        items = [{"uriTemplate": "ferrus://{file}", "name": "ferrus-file",
                  "description": "A file of .ferrus/ by resource name (task, review, state, ...)"},
                 {"uriTemplate": "ferrus://logs/{name}", "name": "ferrus-log",
                  "description": "A check log from .ferrus/logs/: whole up to %d KiB, else its "
                                 "first %d KiB and last %d KiB with a note of what was left out"
                                 % ((LOG_WINDOW_HEAD + LOG_WINDOW_TAIL) // 1024,
                                    LOG_WINDOW_HEAD // 1024, LOG_WINDOW_TAIL // 1024),
                  "mimeType": "text/plain"},
                 {"uriTemplate": "ferrus://logs/{name}{?offset,length}", "name": "ferrus-log-range",
                  "description": "length bytes (at most %d KiB) of a check log from byte offset"
                                 % (LOG_READ_MAX // 1024)},
                 {"uriTemplate": "ferrus://diff/{+path}", "name": "ferrus-diff-path",
                  "description": "The task's diff of one file or folder (path relative to the "
                                 "project root)", "mimeType": "text/x-diff"}]
        return self._page(request, items, "resourceTemplates")

    def _resources_read(self, request):
        uri = request.params.get("uri")
        if not isinstance(uri, str):
            raise RpcError(INVALID_PARAMS, "resources/read needs a string uri")
        try:
            if uri.startswith("ferrus://logs/"):
                contents = read_log_window(self.store, uri)
            else:
                mime, text = read_resource(self.store, uri)
                contents = [{"uri": uri, "mimeType": mime, "text": text}]
        except ResourceNotFound as err:
            # Resource not found: -32002 until 2025-11-25, -32602 in 2026-07-28.
            code = INVALID_PARAMS if request.modern else RESOURCE_NOT_FOUND
            raise RpcError(code, err.full_text(), {"uri": uri}) from err
        except (OSError, FerrusError) as err:
            text = err.full_text() if isinstance(err, FerrusError) else \
                os_error_text("resources/read", err)
            raise RpcError(INTERNAL_ERROR, text, {"uri": uri}) from err
        result = {"contents": contents}
        if request.modern:
            result.update(ttlMs=0, cacheScope="private")
        return result

    def _prompts_list(self, request):
        items = [{"name": name, "description": description} for name, description, _ in PROMPTS]
        return self._page(request, items, "prompts")

    def _prompts_get(self, request):
        name = request.params.get("name")
        entry = next((p for p in PROMPTS if p[0] == name), None)
        if entry is None:
            raise RpcError(INVALID_PARAMS, "Prompt not found: %s" % (name,))
        try:
            text = render_prompt(self.store, name)
        except FerrusError as err:
            raise RpcError(INTERNAL_ERROR, err.full_text()) from err
        except OSError as err:
            raise RpcError(INTERNAL_ERROR, os_error_text("prompts/get", err)) from err
        return {"description": entry[2],
                "messages": [{"role": "user", "content": {"type": "text", "text": text}}]}


# Tools that may block for long (waits, check commands, the repository graph's reading
# and hashing of files): they run in their own bounded lane so they never hold up quick
# calls.
BLOCKING_TOOLS = frozenset(("wait_for_task", "wait_for_review", "wait_for_consult",
                            "wait_for_answer", "check", "submit", "review_pending",
                            "repository_graph_status", "repository_graph_search",
                            "repository_graph_context"))

_OS_ERROR_HINTS = {
    errno.ENOSPC: "the disk is full; free some space and call it again",
    errno.EROFS: "the project is on a read-only file system; ferrus needs to write .ferrus/",
    errno.ENAMETOOLONG: "a file name is too long for this file system; use a shorter name "
                        "(for a spec, a shorter title)",
    errno.EACCES: "ferrus may not write there; check the permissions of .ferrus/",
    errno.EPERM: "ferrus may not write there; check the permissions of .ferrus/",
}
if hasattr(errno, "EDQUOT"):
    _OS_ERROR_HINTS[errno.EDQUOT] = "the disk quota is used up; free some space and retry"


def os_error_text(what, err):
    """A tool-error text for an OSError: what failed, the cause, how to fix it."""
    cause = err.strerror or str(err)
    if err.filename:
        cause += ": %s" % err.filename
    hint = _OS_ERROR_HINTS.get(err.errno, "fix the cause and call it again; the task state "
                                          "was not changed")
    return "ferrus: %s failed: %s\nhint: %s" % (what, cause, hint)


class _McpLogHandler(logging.Handler):
    """Sends ferrus's own warnings and errors to the MCP client too."""

    LEVELS = ((logging.CRITICAL, "critical"), (logging.ERROR, "error"),
              (logging.WARNING, "warning"), (logging.INFO, "info"), (0, "debug"))

    def __init__(self, server):
        super().__init__(logging.WARNING)
        self.server = server
        self._busy = threading.local()

    def emit(self, record):
        if getattr(self._busy, "value", False):
            return  # logging while sending a log message must not loop
        self._busy.value = True
        try:
            owner = getattr(_current_request, "server", None)
            if owner is not None and owner is not self.server.rpc:
                return  # another server in this process is handling that request
            level = next(name for number, name in self.LEVELS if record.levelno >= number)
            request = getattr(_current_request, "value", None)
            self.server.send_log(level, record.getMessage(), request)
        except Exception:  # a log line must never break the server
            pass
        finally:
            self._busy.value = False


_JSON_TYPES = {"string": str, "integer": int, "boolean": bool, "number": (int, float)}


def _argument_problem(tool, arguments):
    """(problem, hint) when ``arguments`` do not fit the tool's inputSchema, else None."""
    expected = {p.name: p for p in tool.params}
    takes = ", ".join("%s (%s)" % (p.name, p.type) for p in tool.params) or "no arguments"
    for name, value in arguments.items():
        if name not in expected:
            return ("unknown argument %r for tool %s" % (name, tool.name),
                    "%s takes %s" % (tool.name, takes))
        kind = expected[name].type
        if not isinstance(value, _JSON_TYPES[kind]) or (
                kind != "boolean" and isinstance(value, bool)):
            return ("argument %r of tool %s must be a %s, got %s" % (
                name, tool.name, kind, _json_type_name(value)),
                "pass %s as a JSON %s" % (name, kind))
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return ("argument %r of tool %s is not valid Unicode (it holds a lone "
                        "surrogate \\u escape)" % (name, tool.name),
                        "send the text as valid UTF-8")
    for param in tool.params:
        if param.required and param.name not in arguments:
            return ("missing required argument %r for tool %s" % (param.name, tool.name),
                    "%s takes %s" % (tool.name, takes))
    return None


def _json_type_name(value):
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {str: "string", int: "integer", float: "number", list: "array",
            dict: "object"}.get(type(value), type(value).__name__)


class ToolCallCounter:
    """This server's ferrus tool calls per task, for the capacity gate.

    Each server owns one small file, .ferrus/usage/<agent>-<pid>.json, so no two
    processes ever write the same file and nothing needs the state lock.  The
    file is rewritten at most every FLUSH_EVERY seconds and at exit, so counting
    costs a tool call next to nothing."""

    FLUSH_EVERY = 0.25

    def __init__(self, agent_name):
        self.agent_name = agent_name
        self.counts = {}
        self._lock = threading.Lock()
        self._stamp = self._task = None
        self._flushed_at = 0.0
        self._dirty = False

    def count(self, store):
        stamp = store.state_stamp()
        with self._lock:
            if stamp != self._stamp:
                self._stamp, self._task = stamp, store.read_state().task_id or "-"
            self.counts[self._task] = self.counts.get(self._task, 0) + 1
            self._dirty = True
            if time.monotonic() - self._flushed_at >= self.FLUSH_EVERY:
                self._write(store)

    def flush(self, store):
        with self._lock:
            if self._dirty:
                self._write(store)

    def _write(self, store):
        name = "%s-%d.json" % (re.sub(r"[^A-Za-z0-9_.-]", "_", self.agent_name), os.getpid())
        os.makedirs(store.path("usage"), exist_ok=True)
        atomic_write(store.path("usage", name), compact_json(
            {"agent_id": self.agent_name, "pid": os.getpid(), "tool_calls": self.counts}),
            durable=False)
        self._flushed_at = time.monotonic()
        self._dirty = False


def tool_calls_for_task(store, task_id, session=None):
    """Ferrus tool calls made for ``task_id``, summed over every server's usage file;
    with ``session``, only over the servers that agent session started (their agent
    id ends in ``/<session>``), so two agents running at once are counted apart."""
    total = 0
    directory = store.path("usage")
    if not task_id or not os.path.isdir(directory):
        return 0
    # The file name carries the agent id ("/" made "_"), so a session's files are found
    # without reading every other server's (HQ asks about each running slot every second).
    marker = "_" + session if session else ""        # a first sieve; the id decides
    for name in os.listdir(directory):
        if not name.endswith(".json") or marker not in name:
            continue
        with contextlib.suppress(ValueError, OSError, AttributeError, TypeError):
            usage = json.loads(read_text(os.path.join(directory, name)))
            if session is None or usage["agent_id"].endswith("/" + session):
                total += int(usage["tool_calls"].get(task_id, 0))
    return total


def tool_calls_for_session(store, session, task_id):
    """The ferrus tool calls agent session ``session`` made for ``task_id``."""
    return tool_calls_for_task(store, task_id, session=session)


def call_on_signal(signum, action):
    """Run ``action`` on a thread as soon as ``signum`` arrives (POSIX, main thread only).

    Complements a Python handler, which waits for the main thread to run."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)

    def watch():
        while True:
            try:
                data = os.read(read_fd, 512)
            except OSError:
                return
            if not data:
                return
            if signum in data:
                action()
                return
    threading.Thread(target=watch, daemon=True, name="signal-%d" % signum).start()


def watch_parent(on_orphaned, interval=1.0):
    """Call ``on_orphaned`` once the process that started us is gone."""
    if IS_WINDOWS:  # pragma: no cover - Windows closes our stdin when the parent dies
        return
    parent = os.getppid()

    def loop():
        while True:
            time.sleep(interval)
            current = os.getppid()
            if current != parent or current <= 1:
                on_orphaned()
                return
    threading.Thread(target=loop, daemon=True, name="parent-watch").start()


def serve_stdio(root, role, agent_name, agent_index, session=None):
    """`ferrus serve`: the MCP server on this process's stdin/stdout."""
    session = session_from_environment(session)
    store = Store(root)
    store.require()
    task = session_task(session)
    if task is not None:
        # An agent of a parallel task: every tool call works on that task alone — never
        # on the checkout's own task, which the server would serve without it.
        if not os.path.isfile(task_record_path(store.dir, task)):
            raise FerrusError("session %s names task %s, which is not a task of this "
                              "project (no %s/%s/%s/%s)" % (
                                  session, task, FERRUS_DIR, TASKS_DIR, task, TASK_RECORD_FILE),
                              "agents of parallel tasks are started by `ferrus run "
                              "--parallel` or HQ; `ferrus tasks` lists the tasks (a session "
                              "of the project's own task has no task id before its dot)")
        store = store.for_task(task)
        if not store.exists():
            raise FerrusError("session %s names task %s, which has not started (it has no "
                              "%s yet)" % (session, task, STATE_FILE),
                              "`ferrus run --parallel N` or HQ starts the queue's tasks "
                              "and their agents")
    report_orphaned_checks(store)
    writer = sys.stdout.buffer
    # Only protocol bytes may reach stdout: anything printed by accident goes to stderr.
    sys.stdout = sys.stderr
    server = FerrusMcpServer(store, role, agent_name, agent_index, sys.stdin.buffer, writer,
                             session=session)

    ending = threading.Lock()

    def orphaned():
        if not ending.acquire(blocking=False):
            return               # already ending (the parent gone and a SIGTERM, say)
        log.info("parent process exited; stopping the MCP server")
        server.rpc.shutdown(wait=2.0)
        end_active_checks()      # os._exit skips atexit
        with contextlib.suppress(FerrusError, OSError):
            server.usage.flush(store)
        os._exit(0)
    watch_parent(orphaned)
    if not IS_WINDOWS:
        # Clients stop servers with SIGTERM: end running checks (their process
        # groups) as EOF does, instead of dying and leaving them behind.  A Python
        # handler runs only when the main thread runs bytecode, and it sits in a
        # blocking read of stdin, or holds a lock the ending needs (run there, the
        # ending waited for itself forever): the handler does nothing but exist, so
        # that the wakeup fd is written by whichever thread takes the signal, and a
        # thread of ours ends the server.
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
        call_on_signal(signal.SIGTERM, orphaned)
    server.serve()
    with contextlib.suppress(FerrusError, OSError):
        server.usage.flush(store)
    return 0
