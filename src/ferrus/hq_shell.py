"""HQ, plain lines: the shell over the controller.

Both front ends drive the UI-independent HqController; HqShell is the one that works
anywhere (a pipe, a dumb terminal, Windows without curses)."""

import argparse
import collections
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

from .basics import (FerrusError, UsageError, __version__, did_you_mean, format_duration,
                     new_id, say, terminal_safe)
from .system import read_text
from .task_machine import S, failure_summary
from .store import (QUEUED_STATUS, RUNNING_STATUS, journal_story, read_task_record,
                    require_utf8)
from .specs import list_spec_paths, parse_spec
from .operations import (HUMAN, ROLES, confirmation_summary, op_clear_selection,
                         op_select_milestone, short_task_id)
from .work import capacity_status, op_answer
from .base_checks import RedBaseRefused
from .task_queue import (foreground_store, foreground_task, op_task_diff, require_task_id,
                         task_elapsed, task_records, task_rows, task_state_word)
from .mcp import SESSION_ENV
from .register import (adapter_for, add_registration_options, agents_report,
                       register_agents, registration_choices, update_hq_config)
from .sandbox_agents import confine_controller
from .prompts import prompt_plan, prompt_spec
from .sessions import (HqMessage, SLOT_ROLES, STATUS_SESSIONS_SHOWN, close_session_record,
                       describe_session, format_usage, open_session_record,
                       read_session_records, usage_summary)
from .controller import HqController
from .scaffold import init_project
from .hq_board import (HQ_COMMANDS, TaskBoard, _color_enabled, format_event,
                       hq_cmd_pipeline, paint_diff)
from .hq_commands import HqTaskCommands


class HqShell(HqTaskCommands):
    """HQ's commands on top of the controller, with a plain-line front end.

    This class is the plain front end (it works without curses, on Windows and
    with piped stdin).  Another front end subclasses it and overrides only the
    terminal parts: ``show``/``write`` (output), ``run`` (the input loop that
    calls ``handle`` per line and ``poll`` between keys), ``confirm``,
    ``interactive`` (handing the terminal to an agent) and ``attach_agent``.

    Parallel tasks (`/run`) are worked by a ParallelRunner, the one `ferrus run
    --parallel` uses, polled beside the project's own controller; `/attach ID` makes one
    task the focus of the output and of /status, /log and /diff."""

    def __init__(self, store, stdin=None, stdout=None, resume=None, clock=time.monotonic):
        self.store = store
        self.stdin = stdin or sys.stdin
        self.stdout = stdout or sys.stdout
        self.resume = resume
        self.lines = collections.deque()
        self.held = None            # messages queued while an interactive agent has the terminal
        self.done = False
        self.clock = clock
        self.controller = HqController(store, self.show, clock=clock, bell=self.ring_bell)
        # [sandbox] on: the project's own task's agents start confined (a missing
        # bubblewrap fails each launch, saying how to install it; HQ itself still starts).
        self.confinement = confine_controller(self.controller, require=False)
        self.runner = None          # the ParallelRunner of /run while it works the queue
        self.run_width = None       # how many at a time /run asked for, until /stop
        self.allow_red_base = False  # /run --allow-red-base: start even on a red target
        self.next_queue_look = 0.0
        self.attached = None        # the task /attach ID follows
        self.hidden = 0             # other tasks' lines left out while attached
        self.board = TaskBoard(store)

    QUEUE_LOOK_SECS = 1.0       # after /run, how often an empty queue is looked at again

    def poll(self):
        """One step of everything HQ drives: the project's task, then the parallel run —
        which, after /run and until /stop, starts again when tasks are queued."""
        self.controller.poll()
        runner = self.runner
        if runner is None:
            if self.run_width and self.clock() >= self.next_queue_look:
                self.next_queue_look = self.clock() + self.QUEUE_LOOK_SECS
                if any(row.get("status") == QUEUED_STATUS for row in self.board.rows()):
                    try:
                        self.start_run(self.run_width)
                    except RedBaseRefused as err:
                        self.run_width = None       # the same base would refuse again
                        self.show(HqMessage("error", "the parallel run cannot start: %s "
                                            % err.full_text(), "run"))
                    except FerrusError as err:
                        self.show(HqMessage("error", "the parallel run cannot start: %s "
                                            "(/run tries again)" % err.full_text(), "run"))
            return
        try:
            runner.step()
        except FerrusError as err:
            self.runner = self.run_width = None
            runner.shutdown()
            self.show(HqMessage("error", "the parallel run stopped: %s (/run starts it again)"
                                % err.full_text(), "run"))
            return
        if runner.finished and runner.halted:
            self.runner = self.run_width = None     # it starts again only when asked
            runner.shutdown()
            self.show(HqMessage("error", "the parallel run stopped (see above); /run starts "
                                "it again", "run"))
            return
        if runner.finished:
            self.runner = None
            runner.shutdown()
            self.show(HqMessage("info", "The queue is done; what is queued next is worked "
                                        "%d at a time too (/stop ends the run)."
                                % self.run_width, "run"))

    def shutdown(self):
        """HQ leaves: every agent it started stops (the tasks stay as they are)."""
        try:
            if self.runner is not None:
                self.runner.shutdown()
        finally:
            self.controller.shutdown()
            if self.confinement is not None:
                self.confinement.close()

    def _runner_emit(self, message):
        """The parallel run's lines: in HQ its own notes say "queue:", not "ferrus run:"."""
        if message.text.startswith("ferrus run: "):
            message.text = "queue: " + message.text[len("ferrus run: "):]
        self.show(message)

    def hides(self, message):
        """While attached to a task, the lines of other tasks are left out (a question or
        a confirmation is still shown: someone must answer it)."""
        task = (message.data or {}).get("task_id") if isinstance(message.data, dict) else None
        return bool(self.attached and task and task != self.attached and
                    message.kind not in ("question", "confirm"))

    def ring_bell(self):
        """[notify] bell: only on a terminal (a pipe would get a stray BEL byte)."""
        if hasattr(self.stdout, "isatty") and self.stdout.isatty():
            self.stdout.write("\a")
            self.stdout.flush()

    def show(self, message):
        if self.held is not None:
            self.held.append(message)
            return
        if self.hides(message):
            self.hidden += 1
            return
        prefix = {"warning": "warning: ", "error": "error: ", "agent": "• "}.get(message.kind, "")
        if message.kind == "question":
            self.write("\n[AWAITING YOUR ANSWER]\n%s\n\nType your answer and press Enter." %
                       message.text)
        elif message.kind == "confirm":
            self.write("\n[AWAITING YOUR CONFIRMATION]\n%s" % message.text)
        else:
            self.write(prefix + message.text)

    def write(self, text):
        say(text, file=self.stdout, flush=True)

    def _reader(self):
        for line in self.stdin:
            self.lines.append(line.rstrip("\n"))
        self.lines.append(None)   # EOF

    def run(self):
        self.write("ferrus HQ %s — /help lists the commands, /quit leaves." % __version__)
        self.write(self.controller.describe_state())
        data = self.controller.task_in_flight()
        if data is not None:
            if self.resume is None:
                self.write("A task is in flight. Resume it? [y/N]")
                self.controller.paused = True
                self.awaiting_resume = True
            else:
                self.controller.paused = not self.resume
                self.write("Resuming it." if self.resume else "Not resuming (use /resume).")
        try:
            self.parallel_tasks_in_flight()
        except FerrusError as err:
            self.write("error: %s" % err.full_text())
        threading.Thread(target=self._reader, daemon=True).start()
        try:
            while not self.done:
                self.poll()
                while self.lines and not self.done:
                    line = self.lines.popleft()
                    if line is None:
                        self.done = True
                        self._say_input_ended()
                        break
                    self.handle(line)
                time.sleep(0.02)
        finally:
            self.shutdown()
        return 0

    def _say_input_ended(self):
        """Plain HQ ends with its input (a pipe, a file); say what that leaves behind, as
        the agents it stops would otherwise vanish without a word."""
        if self.runner is not None and self.runner.controllers:
            self.write("Input ended: HQ leaves and stops the agents of %d parallel task%s; "
                       "they stay in flight: `ferrus run` or /run in `ferrus hq` goes on with "
                       "them." % (len(self.runner.controllers),
                                  "" if len(self.runner.controllers) == 1 else "s"))
        data = self.controller.task_in_flight()
        if data is None:
            return
        running = [slot.name for slot in self.controller.slots.values()
                   if slot.process is not None]
        self.write("Input ended: HQ leaves%s; the task stays %s. `ferrus run --resume` or "
                   "`ferrus hq` goes on with it." % (
                       " and stops the %s" % ", ".join(running) if running else "",
                       data.state))

    # -- input -------------------------------------------------------------------------

    def handle(self, line):
        text = line.strip()
        if getattr(self, "awaiting_resume", False):
            self.awaiting_resume = False
            if text.lower() in ("y", "yes"):
                self.controller.paused = False
                self.write("Resuming.")
                return
            self.write("Not resuming; /resume continues the task later.")
            if not text or text.lower() in ("n", "no"):
                return
        if not text:
            return
        try:
            require_utf8(text, "that line")     # a /tell or an answer would lose it later
        except FerrusError as err:
            self.write("error: %s\nhint: %s" % (err.message, err.hint))
            return
        if not text.startswith("/"):
            self.answer(text)
            return
        name, _, rest = text.partition(" ")
        handler = getattr(self, "cmd_" + name[1:].replace("-", "_"), None)
        if handler is None or name not in [c[0] for c in HQ_COMMANDS]:
            known = did_you_mean(name, [c[0] for c in HQ_COMMANDS])
            self.write("error: unknown command %s — %s/help lists them" % (
                name, "did you mean %s? " % known if known else ""))
            return
        try:
            handler(rest.strip())
        except FerrusError as err:
            self.write("error: %s" % err.message + ("\nhint: %s" % err.hint if err.hint else ""))

    # -- parallel tasks ----------------------------------------------------------------

    def parallel_tasks_in_flight(self):
        """At start-up: parallel tasks a previous run left in flight are resumed with
        --resume, else HQ says how to resume them."""
        running = [task for task, record in task_records(self.store)
                   if record.get("status") == RUNNING_STATUS and record.get("worktree")]
        if not running:
            return
        what = "%d parallel task%s in flight (%s)" % (
            len(running), " is" if len(running) == 1 else "s are",
            ", ".join(short_task_id(task) for task in running))
        if self.resume:
            self.write(what + "; resuming.")
            self.cmd_run("")
        else:
            self.write(what + "; /run resumes them, /tasks shows the board.")

    def running_task_ids(self):
        """The parallel tasks with a store of their own that have not ended."""
        return [task for task, record in task_records(self.store)
                if record.get("status") == RUNNING_STATUS and
                self.store.for_task(task).exists()]

    def task_controller(self, task):
        """The controller driving ``task`` in this HQ's run, if one does."""
        return self.runner.controllers.get(task) if self.runner is not None else None

    def human_target(self, states):
        """The store a human's answer or verdict is for: the attached task's, else the only
        parallel task in one of ``states``, else the project's."""
        if self.attached and self.store.for_task(self.attached).exists():
            with contextlib.suppress(FerrusError):
                if self.store.for_task(self.attached).read_state().state in states:
                    return self.store.for_task(self.attached)
        waiting = []
        for task in self.running_task_ids():
            with contextlib.suppress(FerrusError):
                if self.store.for_task(task).read_state().state in states:
                    waiting.append(task)
        if len(waiting) > 1:
            raise FerrusError("tasks %s all wait for you" % ", ".join(
                short_task_id(task) for task in waiting), "/attach ID picks the task, then "
                                                          "answer (or /approve, /reject NOTES)")
        return self.store.for_task(waiting[0]) if waiting else self.store

    def task_word(self, word):
        """The task ``word`` names (its id or the end of it, as lines show it), or None
        when it names none."""
        if not word or len(word) < 4 or word.startswith("-"):
            return None
        with contextlib.suppress(FerrusError):
            return require_task_id(self.store, word)
        return None

    def answer(self, text):
        try:
            store = self.human_target((S.AWAITING_HUMAN, S.AWAITING_CONFIRMATION))
        except FerrusError as err:
            self.write("error: %s\nhint: %s" % (err.message, err.hint))
            return
        data = store.read_state()
        if data.state == S.AWAITING_CONFIRMATION:
            self.write("error: the reviewer's approval waits for you: /approve, or /reject "
                       "NOTES (a plain line answers only an agent's question)")
            return
        if data.state != S.AWAITING_HUMAN:
            self.write("error: commands start with '/' (try /help); nobody is waiting for an "
                       "answer (state %s)" % data.state)
            return
        op_answer(store, HUMAN, text)
        self.write("Answer recorded; the agent continues.")

    def confirm(self, question):
        self.write(question + " [y/N]")
        while not self.lines:
            self.poll()
            time.sleep(0.02)
        reply = self.lines.popleft()
        if reply is None:
            self.done = True
            return False
        return reply.strip().lower() in ("y", "yes")

    # -- commands ----------------------------------------------------------------------

    HELP_WIDTH = 80        # /help fits an 80-column terminal
    HELP_COLUMN = 24       # where the descriptions start

    def cmd_help(self, rest):
        import textwrap
        width, column = self.HELP_WIDTH, self.HELP_COLUMN
        for name, args, what in HQ_COMMANDS:
            usage = ("%s %s" % (name, args)).strip()
            body = textwrap.wrap(what, width - column)
            if len(usage) <= column - 4:        # two spaces before the description
                lines = ["  " + usage.ljust(column - 2) + body[0]]
                body = body[1:]
            else:              # a long usage gets its own lines, the description below it
                lines = textwrap.wrap(usage, width - 2, initial_indent="  ",
                                      subsequent_indent="    ")
            lines += [" " * column + line for line in body]
            self.write("\n".join(lines))
        self.write("  Anything not starting with / answers the pending question.")

    def busy_agents(self):
        """The slots whose agents would lose work if HQ quit now, as "executor, reviewer";
        agents that only finish after the task ended have no work left to lose."""
        busy = [slot.name for slot in self.controller.running()] \
            if self.controller.finishing_since is None else []
        if self.runner is not None:
            busy += ["%s of %s" % (slot.name, short_task_id(task))
                     for task, controller in self.runner.controllers.items()
                     if controller.finishing_since is None for slot in controller.running()]
        return ", ".join(busy)

    def quit_unless_declined(self):
        busy = self.busy_agents()
        if not busy or self.confirm("Agents are running (%s); stop them and quit?" % busy):
            self.done = True

    def cmd_quit(self, rest):
        self.quit_unless_declined()

    def cmd_status(self, rest):
        task = self.task_word(rest) or (None if rest else self.attached)
        if rest and task is None:
            raise UsageError("usage: /status [ID] — no task %s in the queue (/tasks lists them)"
                             % rest)
        if task is not None:
            self.task_status(task)
            return
        self.write(self.controller.describe_state())
        capacity = capacity_status(self.store, self.store.read_state())
        if capacity:
            self.write("capacity %s (%s)%s" % (capacity["tier"], capacity["action"],
                                               " — checkpoint" if capacity["checkpoint"] else ""))
        data = self.store.read_state()
        if data.selected_spec:
            self.write("spec %s, milestone %s" % (data.selected_spec,
                                                  data.selected_milestone or "(none left)"))
        for slot in self.controller.slots.values():
            self.write("  " + slot.describe(self.controller.tool_calls_of(slot)))
        records = [r for r in read_session_records(self.store)
                   if data.task_id and r.get("task_id") == data.task_id]
        if records:
            self.write("task %s: %s" % (data.task_id, format_usage(usage_summary(records))))
            for record in records[-STATUS_SESSIONS_SHOWN:]:
                self.write("  " + terminal_safe(describe_session(record)))
        if data.state == S.AWAITING_CONFIRMATION:
            # The mirrored parallel task's own files, when STATE.json mirrors one.
            self.write(confirmation_summary(foreground_store(self.store), data))
        rows = self.board.rows(force=True)
        if rows:
            self.write("tasks: %s — /tasks shows the board%s" % (
                self.board.summary(rows), "" if self.runner is not None or self.run_width else
                ", /run works the queue" if any(row.get("status") in (
                    QUEUED_STATUS, RUNNING_STATUS) for row in rows) else ""))

    def task_status(self, task):
        """/status of one task of the queue: where it stands, its agents and sessions."""
        record = read_task_record(self.store.dir, task)
        task_store = self.store.for_task(task)
        rows = [row for row in task_rows(self.store) if row["id"] == task]
        row = rows[0] if rows else {"id": task, "status": record.get("status")}
        elapsed = task_elapsed(row, self.store.clock())
        self.write("Task %s: %s — %s%s" % (
            short_task_id(task), record.get("title", ""), task_state_word(row),
            ", for %s" % format_duration(elapsed) if elapsed is not None else ""))
        if task_store.exists():
            data = task_store.read_state()
            self.write("check retries %d, review cycles %d" % (data.check_retries,
                                                              data.review_cycles))
            if data.failure_reason:
                self.write("failure: %s" % failure_summary(data.failure_reason))
        if record.get("worktree"):
            self.write("worktree %s, branch %s" % (record["worktree"], record.get("branch")))
        if record.get("merged_commit"):
            self.write("merged into %s at %s" % (record.get("target") or "the target",
                                                 record["merged_commit"][:12]))
        if record.get("reason") and not task_store.exists():
            self.write("reason: %s" % failure_summary(record["reason"]))
        controller = self.task_controller(task)
        if controller is not None:
            for slot in controller.slots.values():
                self.write("  " + slot.describe(controller.tool_calls_of(slot)))
        elif record.get("status") == RUNNING_STATUS:
            self.write("  no agent of it runs here (/run resumes it)")
        sessions = [r for r in read_session_records(self.store) if r.get("task_id") == task]
        if sessions:
            self.write("usage: %s" % format_usage(usage_summary(sessions)))
            for session in sessions[-STATUS_SESSIONS_SHOWN:]:
                self.write("  " + terminal_safe(describe_session(session)))
        if task_store.exists() and task_store.read_state().state == S.AWAITING_CONFIRMATION:
            self.write(confirmation_summary(task_store, task_store.read_state()))

    def cmd_log(self, rest):
        words = rest.split()
        everything = "--all" in words
        named = [w for w in words if w != "--all" and self.task_word(w)]
        numbers = [w for w in words if w != "--all" and w not in named]
        if len(named) > 1 or len(numbers) > 1 or (numbers and not numbers[0].isdigit()):
            raise UsageError("usage: /log [ID] [N] [--all] — ID is a task of the queue "
                             "(/tasks lists them)")
        count = int(numbers[0]) if numbers else 20
        task = self.task_word(named[0]) if named else self.attached
        entries = journal_story(self.store, count, everything, task=task)
        for entry in entries:
            self.write(format_event(entry))
        if not entries:
            self.write("(nothing yet%s)" % ("" if everything else "; /log --all also shows the "
                                                                "bookkeeping entries"))

    def cmd_diff(self, rest):
        words = rest.split()
        stat_only = "--stat" in words
        named = [w for w in words if w != "--stat" and self.task_word(w)][:1]
        paths = [w for w in words if w != "--stat" and w not in named] or None
        task = self.task_word(named[0]) if named else self.attached
        # Without one named or attached: the parallel task the state mirrors, if any.
        outcome = op_task_diff(self.store, task or foreground_task(self.store), stat_only,
                               paths)
        if not outcome.data.get("available"):
            self.write(outcome.text + ("\nhint: %s" % outcome.data["hint"]
                                       if outcome.data.get("hint") else ""))
            return
        self.page("diff", outcome.text)

    def page(self, title, text):
        """Long output (a diff): all of it here, coloured where the terminal allows."""
        if _color_enabled(self.stdout):
            print(paint_diff(text, True), file=self.stdout, flush=True)
        else:
            self.write(text)

    def cmd_agents(self, rest):
        for row in agents_report(self.store.root):
            self.write("%s: %s%s%s" % (row["role"], row["agent"], " — " + row["problem"]
                                       if "problem" in row else " — ok",
                                       ", permissions %s" % row["permissions"]
                                       if "permissions" in row else ""))
            for warning in row.get("warnings", ()):
                self.write("  warning: %s (%s)" % (warning["warning"], warning["hint"]))

    def cmd_attach(self, rest):
        if rest in SLOT_ROLES:
            self.attach_agent(rest)
            return
        if not rest:
            if self.attached is None:
                raise UsageError("usage: /attach ID (follow a task) or /attach ROLE (an "
                                 "agent's live log); /tasks lists the tasks")
            self.write("Detached from task %s%s; every task's lines are shown again." % (
                short_task_id(self.attached), " (%d of other tasks' lines were left out; "
                "/log shows what happened)" % self.hidden if self.hidden else ""))
            self.attached, self.hidden = None, 0
            return
        task = self.task_word(rest)
        if task is None:
            raise UsageError("no task or agent role %r (tasks: /tasks lists them; roles: %s)"
                             % (rest, ", ".join(SLOT_ROLES)))
        record = read_task_record(self.store.dir, task)
        self.attached, self.hidden = task, 0
        self.write("Following task %s (%s): only its lines are shown; /status, /log and /diff "
                   "show it; /attach alone shows every task again." % (
                       short_task_id(task), record.get("title", "")))
        for entry in journal_story(self.store, 5, task=task):
            self.write(format_event(entry))

    def focus_controller(self):
        """The controller of the attached task when this HQ runs it, else the project's."""
        return (self.task_controller(self.attached) if self.attached else None) or \
            self.controller

    def attach_agent(self, rest):
        controller = self.focus_controller()
        slot = controller.slots.get(rest)
        if slot is None or slot.process is None:
            raise UsageError("no running agent called %r (running: %s)" % (rest, ", ".join(
                s.name for s in controller.running()) or "none"))
        self.write("--- %s (Enter returns) ---" % self.store.relpath(slot.process.log_path))
        with open(slot.process.log_path, "r", encoding="utf-8", errors="replace") as handle:
            self.write(handle.read()[-4000:].rstrip())
            while not self.lines and slot.process is not None:
                chunk = handle.read()
                if chunk:
                    self.write(chunk.rstrip())
                self.poll()
                time.sleep(0.1)
        if self.lines and self.lines[0] is not None:
            self.lines.popleft()
        self.write("--- detached ---")

    def cmd_tell(self, rest):
        role, _, message = rest.partition(" ")
        if not message.strip():
            raise UsageError("usage: /tell ROLE MESSAGE (roles: executor, reviewer, consultant)")
        self.driving()[1].tell(role, message.strip())

    def cmd_pipeline(self, rest):
        hq_cmd_pipeline(self, rest)

    def cmd_plan(self, rest):
        self.interactive("supervisor", prompt_plan())

    def cmd_spec(self, rest):
        self.interactive("supervisor", prompt_spec())

    def cmd_supervisor(self, rest):
        self.interactive("supervisor", None)

    def cmd_executor(self, rest):
        self.interactive("executor", None)

    def cmd_milestones(self, rest):
        parts = rest.split()
        if parts:
            self.write(op_select_milestone(self.store, HUMAN, parts[0],
                                           parts[1] if len(parts) > 1 else None).text)
            return
        config = self.store.config()
        paths = list_spec_paths(self.store.root, config)
        if not paths:
            self.write("no specs in %s/ yet: /spec drafts one with the supervisor"
                       % config.spec.directory.strip().rstrip("/"))
        for path in paths:
            self.write(path)
            for milestone in parse_spec(read_text(os.path.join(self.store.root, path))):
                self.write("   [%s] %s (%s)" % ("x" if milestone.completed else " ",
                                                milestone.display(), milestone.id))

    def cmd_reset_spec(self, rest):
        self.write(op_clear_selection(self.store, HUMAN).text)

    def cmd_model(self, rest):
        parts = rest.split(None, 1)
        if len(parts) != 2 or parts[0] not in ROLES:
            raise UsageError("usage: /model supervisor|executor MODEL (or --clear)")
        config = self.store.config().require_hq()
        choice = getattr(config, parts[0])
        if choice is None:
            raise FerrusError("no [hq.%s] agent yet" % parts[0], "/register first")
        model = "" if parts[1] == "--clear" else parts[1]
        update_hq_config(self.store.root, parts[0], choice.agent, model, self.write)

    def cmd_register(self, rest):
        usage = UsageError("usage: /register [--supervisor A] [--executor A] "
                           "[--supervisor-model M] [--executor-model M] [--trust]")

        class Parser(argparse.ArgumentParser):
            def error(self, message):       # never print over the screen, never exit
                raise usage
        args = add_registration_options(Parser(add_help=False)).parse_args(rest.split())
        choices, _ = registration_choices(args, self.store.root)
        # Through write(), so the output lands in HQ's transcript, not over the screen.
        register_agents(self.store.root, choices, trust=args.trust, report=self.write)

    def cmd_init(self, rest):
        args = rest.split()
        init_project(self.store.root, args[1] if len(args) == 2 else None, self.write)

    def interactive(self, role, prompt):
        """Hand the terminal to an agent; reactions keep running meanwhile."""
        config = self.store.config().require_hq()
        choice = getattr(config, role)
        if choice is None:
            raise FerrusError("no [hq.%s] agent in ferrus.toml" % role,
                              "/register --%s <agent>" % role)
        adapter = adapter_for(config, choice.agent)
        launch = adapter.interactive(self.store.root, role, prompt, choice.model)
        env = dict(os.environ)
        env.update(launch.env)
        env["PWD"] = os.path.abspath(self.store.root)   # opencode takes its folder from $PWD
        env[SESSION_ENV] = new_id("s")       # its leases name this session, as headless ones do
        self.held = []
        try:
            proc = subprocess.Popen(launch.argv, cwd=self.store.root, env=env)
        except OSError as err:
            self.held = None
            raise FerrusError("could not start %s: %s" % (launch.argv[0], err),
                              adapter.install_hint()) from err
        # The terminal is the agent's, so ferrus reads none of its output: the record
        # has the when and the exit, and says that its usage is unknown.
        record = open_session_record(
            self.store, env[SESSION_ENV], slot="interactive %s" % role, role=role,
            agent=choice.agent, model=choice.model or "", pid=proc.pid, argv=list(launch.argv),
            prompt=prompt, task_id=self.store.read_state().task_id, usage_reported=False)
        # Ctrl+C belongs to the agent now: HQ ignores it with a Python handler (not
        # SIG_IGN, which the agent would inherit) instead of dying and orphaning agents.
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGINT, lambda signum, frame: None)
        try:
            while proc.poll() is None:
                self.poll()
                time.sleep(0.05)
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
            close_session_record(self.store, record, "ended" if proc.poll() is not None
                                 else "left running", proc.returncode,
                                 note="interactive: its output went to the terminal, so its "
                                      "tool calls, tokens and cost are not known")
            held, self.held = self.held, None
            for message in held:
                self.show(message)
