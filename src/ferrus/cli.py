"""CLI: argparse, every `ferrus` command, main(argv).

The argparse front end, every `ferrus` command, and ``main(argv) -> int``."""

import argparse
import contextlib
import json
import logging
import os
import re
import signal
import sys
import threading

from .startup import command_word
from .basics import (FerrusError, UsageError, __version__, did_you_mean, log, say,
                     terminal_safe)
from .system import read_text
from .config import CONFIG_FILE, PLACE_HERE, load_config
from .task_machine import S, WORK_STATES
from .store import (FERRUS_DIR, QUEUED_STATUS, RUNNING_STATUS, Store, read_task_record,
                    require_utf8)
from .checks import _status_note, report_orphaned_checks
from .sandbox import SANDBOX_RELAY_ENV
from .operations import (Caller, HUMAN, ROLES, confirmation_summary, op_human_approve,
                         op_human_reject, short_task_id)
from .work import op_check, op_force_reset, op_run_checks_only
from .task_queue import (op_enqueue_milestone, op_enqueue_ready, op_enqueue_task,
                         op_retry_task, stores_awaiting_confirmation, task_records,
                         task_store_of)
from .graph import add_graph_parser
from .memory import add_memory_parser, add_spec_parser
from .mcp import SESSION_ENV, serve_stdio
from .server_host import SERVER_HOST_COMMAND, host_sessions
from .nano import add_nano_parser
from .probe import add_probe_option, report_probes
from .register import (adapter_for, add_registration_options, agents_report,
                       register_agents, registration_choices, unregister_agents)
from .sandbox_agents import relay_mcp_stdio, sandbox_agent_report
from .places import add_places_parser
from .sessions import HqMessage
from .notify import terminal_bell
from .orchestrator import OrchestratorLock
from .place_tasks import places_elsewhere
from .race import op_enqueue_race, parse_race
from .parallel import live_parallel_run
from .task_cancel import cancel_needs_confirmation, cancel_queue_task
from .run import (run_loop, run_milestones, run_parallel, run_printer, run_queue,
                  settle_checkout_queue_task)
from .pipelines import _pipeline_result, pipeline_command
from .scaffold import init_project
from .doctor import doctor_findings
from .hq_curses import hq_front_end
from .cli_views import (cmd_diff, cmd_journal, cmd_log, cmd_sessions, cmd_status,
                        cmd_tasks, cmd_usage)
from .web import add_web_options, add_web_parser, start_web_beside


def invoked_as():
    """How the user started ferrus, for hints they can paste: ``ferrus`` from the
    launcher or an installed command, else the interpreter and this file."""
    program = os.path.basename(sys.argv[0] if sys.argv and sys.argv[0] else "")
    if program in ("ferrus", "ferrus.exe"):
        return "ferrus"
    if program == "__main__.py" or program == "-m":
        return "python3 -m ferrus"
    return "python3 %s" % os.path.abspath(__file__)


def cmd_init(args, root):
    init_project(root, args.agents_path)
    print()
    me = invoked_as()
    # Name only the steps still to do: `init` run again in a set-up project would
    # otherwise send its user back to steps done long ago.
    steps = []
    checks_set = registered = False
    with contextlib.suppress(FerrusError, OSError):
        config = load_config(root)
        checks_set = bool(config.checks.commands)
        hq = config.require_hq()
        registered = all(
            getattr(hq, role) is not None and adapter_for(config, getattr(hq, role).agent)
            .registration(root, role) is not None for role in ROLES)
    if not checks_set:
        steps.append("put your lint and test commands in [checks] of ferrus.toml")
    if not registered:
        steps.append("`%s register` (the agents [hq.*] names; or --supervisor A "
                     "--executor A)" % me)
    steps.append("`%s run --task \"...\"`" % me)
    print("ferrus is initialized. Next: %s." % ", then ".join(steps))
    return 0


def cmd_task(args, root):
    store = Store(root).require()
    caller = human_caller()
    if args.task_command == "cancel":
        question = None if args.yes else cancel_needs_confirmation(store, args.id,
                                                                   args.discard)
        if question and not confirm(question):
            say("Nothing changed.")
            return 1
        cancel_queue_task(store, caller, args.id, args.discard, out=say)
        return 0
    if args.task_command == "retry":
        say(op_retry_task(store, caller, args.id).text)
        return 0
    sources = [name for name in ("text", "file", "milestone", "ready")
               if getattr(args, name)]
    if len(sources) != 1:
        raise UsageError("say what to queue: TEXT, --file F, --milestone SPEC ID or --ready SPEC "
                         "(one of them)", 'ferrus task add "Add a --verbose flag"')
    if args.milestone or args.ready:
        if args.agent or args.race:
            raise UsageError("--%s goes with a task given as TEXT or --file" % (
                "agent" if args.agent else "race"))
        outcome = op_enqueue_milestone(store, caller, *args.milestone) if args.milestone \
            else op_enqueue_ready(store, caller, args.ready)
    else:
        text = " ".join(args.text)
        if args.file:
            try:
                text = sys.stdin.read() if args.file == "-" else read_text(args.file)
            except OSError as err:
                raise FerrusError("cannot read --file %s: %s" % (args.file, err.strerror),
                                  "give the path of a text file holding the task, or - for "
                                  "stdin") from err
        if args.race:
            attempts = parse_race(args.race, store.config(), args.agent)
            outcome = op_enqueue_race(store, caller, text, attempts)
        else:
            outcome = op_enqueue_task(store, caller, text, agent=args.agent)
    say(outcome.text)
    return 0


def confirm(question):
    """Ask a yes/no question on the terminal; refuse to guess without one."""
    if not sys.stdin.isatty():
        raise UsageError("%s — stdin is not a terminal, so nobody can answer" % question,
                         "pass --yes to confirm")
    try:
        answer = input("%s [y/N] " % question)
    except EOFError:            # Ctrl+D answers no, as Enter does
        say()
        return False
    return answer.strip().lower() in ("y", "yes")


def cmd_reset(args, root):
    store = Store(root).require()
    data = store.read_state()
    if data.state == S.IDLE:
        say("Nothing to reset: the state is already Idle.")
        return 0
    if not args.yes:
        if not confirm("Reset the task (state %s) to Idle and clear its files?" % data.state):
            say("Nothing changed.")
            return 1
    say(op_force_reset(store, HUMAN).text)
    return 0


def human_caller():
    """The human, unless this shell belongs to an agent session HQ started (its
    environment names the session): then an agent, whom the operations refuse."""
    session = os.environ.get(SESSION_ENV)
    return Caller("agent", "agent/%s" % session) if session else HUMAN


def confirmation_store(store, task, verb):
    """The store of the task ``ferrus approve/reject`` acts on: ``--task`` names it; else
    the one task waiting for a confirmation; with none, the checkout's (the operation then
    says why there is nothing to confirm)."""
    if task:
        return task_store_of(store, task)
    waiting = stores_awaiting_confirmation(store)
    if len(waiting) > 1:
        raise UsageError("%d tasks wait for your confirmation: %s" % (len(waiting), ", ".join(
            "%s (%s)" % (short_task_id(t), read_task_record(store.dir, t).get("title") or t)
            for t, _ in waiting)), "name one: `ferrus %s --task %s`" % (
                verb, short_task_id(waiting[0][0])))
    return waiting[0][1] if waiting else store


def cmd_approve(args, root):
    store = confirmation_store(Store(root).require(), args.task, "approve")
    caller = human_caller()
    data = store.read_state()
    if data.state != S.AWAITING_CONFIRMATION or caller.is_agent:
        say(op_human_approve(store, caller).text)     # refuses, saying why
        return 0
    if not args.yes:
        say(terminal_safe(confirmation_summary(store, data)))
        say()
        if not confirm("Approve task %s?" % (data.task_id or "")):
            say("Nothing changed.")
            return 1
    outcome = op_human_approve(store, caller)
    say(outcome.text)
    if store.task is None:
        settle_checkout_queue_task(store)   # a queued task approved after its run stopped
    if outcome.data.get("state") == S.INTEGRATING.value and live_parallel_run(Store(root)) is None:
        say("No run is working the queue now: the next `ferrus run --parallel` (or HQ's "
            "/run) merges it.")
    return 0


def cmd_reject(args, root):
    store = confirmation_store(Store(root).require(), args.task, "reject")
    notes = " ".join(args.notes)
    if args.file:
        if notes:
            raise UsageError("give the notes as words or with --file, not both")
        try:
            notes = sys.stdin.read() if args.file == "-" else read_text(args.file)
        except OSError as err:
            raise FerrusError("cannot read --file %s: %s" % (args.file, err.strerror),
                              "give the path of a text file holding your notes, or - for stdin") from err
    if not notes.strip():
        raise UsageError("the rejection needs notes: what must change",
                         "ferrus reject \"Handle the empty input too\" (or --file NOTES.md)")
    say(op_human_reject(store, human_caller(), notes).text)
    return 0


def cmd_doctor(args, root):
    code = _doctor_report(args, root)
    if args.probe:
        say()
        code = max(code, report_probes(root))
    return code


def _doctor_report(args, root):
    findings = doctor_findings(root)
    if not findings:
        say("ferrus doctor: everything is consistent.")
        return 0
    remaining = repaired = 0
    for finding in findings:
        say("%s: %s" % (finding.severity, finding.problem))
        if args.fix and finding.fix is not None:
            try:
                finding.fix()
                say("  fixed: %s" % finding.repair)
                repaired += 1
                continue
            except (OSError, FerrusError) as err:
                say("  could not fix: %s" % err)
        elif finding.fix is not None:
            say("  repair: %s (run `ferrus doctor --fix`)" % finding.repair)
        else:
            say("  what to do: %s" % finding.repair)
        if finding.severity == "error":
            remaining += 1
    warnings = sum(1 for finding in findings if finding.severity == "warning")
    if args.fix:
        # Fixes can reveal or resolve others; report what is still wrong.
        left = [f for f in doctor_findings(root) if f.severity == "error"]
        done = "repaired %d problem(s)" % repaired if repaired else "repaired nothing"
        if left:
            say("ferrus doctor: %s; %d error(s) remain (see above for what to do)."
                % (done, len(left)))
        elif repaired:
            say("ferrus doctor: %s; no errors remain." % done)
        else:
            say("ferrus doctor: there was no error to repair (%d warning(s) above)." % warnings)
        return 1 if left else 0
    if not remaining:
        say("ferrus doctor: everything is consistent, with %d warning(s) above." % warnings
            if warnings else "ferrus doctor: everything is consistent (see the notes above).")
    return 1 if remaining else 0


def cmd_check(args, root):
    store = Store(root).require()
    report_orphaned_checks(store)
    if args.task:
        store = task_store_of(store, args.task)
    if args.force:
        run, config = op_run_checks_only(store)
        if run is None:
            say("No check commands are configured in ferrus.toml ([checks] commands).")
            return 0
        for result in run.results:
            say("%-9s %s%s" % (result.status, result.command, _status_note(result)
                                 if not result.passed else ""))
        if not run.passed:
            say()
            say(run.report(config.limits.max_feedback_lines))
        else:
            say("All checks passed. Full log: %s" % run.log_path)
        return 0 if run.passed else 1
    try:
        outcome = op_check(store, Caller("human", "human:cli:0"))
    except FerrusError as err:
        if store.read_state().state in WORK_STATES:
            raise
        # The agents' message cannot mention a CLI flag; the human at the shell can use it.
        raise FerrusError(err.message, "`ferrus check --force` runs the checks in any state "
                                       "and changes nothing") from err
    say(outcome.text)
    return 0 if outcome.data.get("passed") else 1


def cmd_register(args, root):
    choices, from_config = registration_choices(args, root)
    if from_config:
        say("Registering the agents ferrus.toml names: %s" % ", ".join(
            "%s %s" % (role, agent) for role, (agent, _model) in choices.items()))
    register_agents(root, choices, trust=args.trust)
    print()
    print("Done. `ferrus agents` shows whether each agent is installed and connected.")
    return 0


def cmd_unregister(args, root):
    roles = [role for role in ROLES if getattr(args, role)] or list(ROLES)
    unregister_agents(root, roles)
    return 0


def cmd_agents(args, root):
    if args.probe:
        return report_probes(root, as_json=args.json)
    rows = agents_report(root)
    if load_config(root).places[PLACE_HERE].sandbox.enabled:
        # Whether each CLI starts inside the sandbox its tasks' agents run in.
        inside = sandbox_agent_report(root)
        for row in rows:
            found = next((r for r in inside if r["role"] in (row["role"], None)), None)
            if found is not None:
                row["sandbox"] = {key: found[key] for key in ("works", "note", "problem",
                                                              "hint") if key in found}
    failed = any("problem" in row or not row.get("sandbox", {"works": True})["works"]
                 for row in rows)
    if args.json:
        say(json.dumps(rows, indent=2))
        return 1 if failed else 0
    for row in rows:
        if row["agent"] is None:
            say("%-10s (none)  %s" % (row["role"], row["problem"]))
        else:
            say("%-10s %s%s" % (row["role"], row["agent"],
                                  " (model %s)" % row["model"] if row["model"] else ""))
            say("           binary: %s" % (row["path"] or "not installed"))
            if row["path"]:
                say("           version: %s" % (row["version"] or "unknown (--version failed)"))
            say("           MCP: %s" % ("points at this ferrus" if row["points_here"] else
                                          "registered elsewhere" if row["registered"] else
                                          "not registered"))
            say("           permissions: %s (%s)%s" % (
                row["permissions"], row["permissions_from"],
                ": " + " ".join(row["permission_args"]) if row["permission_args"] else ""))
        for warning in row.get("warnings", ()):
            say("           warning: %s" % warning["warning"])
            say("           fix: %s" % warning["hint"])
        sandbox = row.get("sandbox")
        if sandbox is not None:
            say("           sandbox: %s" % (sandbox.get("note") or sandbox.get("problem")))
            if sandbox.get("hint"):
                say("           fix: %s" % sandbox["hint"])
        if "problem" in row:
            say("           problem: %s" % row["problem"])
            say("           fix: %s" % row["hint"])
    return 1 if failed else 0


def cmd_run(args, root):
    if args.timeout is not None and not args.timeout > 0:     # also refuses NaN
        raise UsageError("--timeout must be a positive number of seconds, got %g"
                         % args.timeout, "leave --timeout out to run until the task ends")
    store = Store(root).require()
    report_orphaned_checks(store)
    task = args.task
    if args.task_file:
        try:
            task = sys.stdin.read() if args.task_file == "-" else read_text(args.task_file)
        except OSError as err:
            raise FerrusError("cannot read --task-file %s: %s" % (args.task_file, err.strerror),
                              "give the path of a text file holding the task, relative to "
                              "the current folder, - for stdin, or pass the task as --task "
                              "TEXT") from err
    mode = "json" if args.json else "quiet" if args.quiet else "lines"
    # JSON goes to programs, which answer no questions and want no bell characters.
    interactive = sys.stdin.isatty() and mode != "json"
    bell = terminal_bell(sys.stdout) if mode != "json" else None

    def ask(question):
        if not interactive:
            return None
        # The question itself is already on the screen (the run's own event line).
        say("Your answer to the question above:", flush=True)
        try:
            return input("answer> ")
        except EOFError:        # Ctrl+D: no answer now; the question keeps waiting
            say()
            return None

    def review(summary):
        """The human's word on the reviewer's approval shown above ([hq] human_review)."""
        if not interactive:
            return None
        try:
            while True:
                reply = input("approve? y approves, r rejects with notes, Enter decides "
                              "later> ").strip().lower()
                if reply in ("y", "yes"):
                    return "approve", None
                if reply in ("r", "reject", "n", "no"):
                    notes = input("notes for the executor> ")
                    if notes.strip():
                        return "reject", notes
                    say("a rejection needs notes saying what must change", flush=True)
                elif not reply:
                    return None
        except EOFError:
            return None
    if args.until_done and task is not None:
        raise UsageError("--until-done works through spec milestones; it cannot follow --task",
                         "use `ferrus run --until-done` (or `--milestone ID --until-done`)")
    if args.parallel is not None and not 1 <= args.parallel <= 64:
        raise UsageError("--parallel takes a number of tasks from 1 to 64, got %d"
                         % args.parallel, "ferrus run --parallel 3")
    elsewhere = False
    parallel = args.parallel
    if parallel is None:
        # A ferrus.toml that does not load is reported by the run itself, as ever.
        with contextlib.suppress(FerrusError):
            parallel = store.config().parallel.max_tasks
    parallel = parallel or 1
    with contextlib.suppress(FerrusError):
        # Tasks sent to places are always worked by the parallel runner (even one here).
        elsewhere = places_elsewhere(store.config())
    if (parallel > 1 or elsewhere) and (args.milestone or args.until_done or args.resume or
                                        args.reset):
        raise UsageError("tasks run in parallel come from the queue",
                         "queue them with `ferrus task add` (--milestone SPEC ID, --ready "
                         "SPEC), then `ferrus run --parallel N`; an interrupted task is "
                         "resumed by the next run, a failed one once `ferrus task retry ID` "
                         "queues it again")
    with OrchestratorLock(store, "ferrus run") as held:
        show = run_printer(lambda text: say(text, flush=True), mode)
        for note in held.notes:
            show(HqMessage("info", "ferrus run: %s" % note, "run"))
        # The board's URL goes to stderr: with --json, stdout is JSON only.
        board = start_web_beside(store, args.web_host, args.web_port,
                                 lambda text: say(text, file=sys.stderr, flush=True),
                                 args.web_tls_cert, args.web_tls_key,
                                 args.web_allow_host) if args.web else None
        try:
            return _run_as_asked(store, args, task, parallel, elsewhere, mode, ask, review,
                                 bell, show)
        finally:
            if board is not None:
                board.close()


def _run_as_asked(store, args, task, parallel, elsewhere, mode, ask, review, bell, show):
    """cmd_run's work once the orchestrator lock is held: the queue in parallel (always
    when tasks go to places), milestones, the queue one task at a time, or the one task."""
    if parallel > 1 or elsewhere:
        if task is not None:
            require_utf8(task, "the task description")
            show(HqMessage("info", "ferrus run: " + op_enqueue_task(
                store, human_caller(), task).text, "run"))
        # At places, without --parallel this machine's share is [places.here] slots.
        return run_parallel(store, args.parallel if elsewhere else parallel, args.timeout,
                            ask=ask, review=review, mode=mode, bell=bell,
                            allow_red_base=args.allow_red_base)
    if args.milestone or args.until_done:
        return run_milestones(store, args.milestone or "next", args.until_done,
                              args.timeout, args.resume, args.reset, ask=ask, review=review,
                              mode=mode, bell=bell, allow_red_base=args.allow_red_base)
    if task is None and not args.resume and any(
            record.get("status") in (QUEUED_STATUS, RUNNING_STATUS)
            for _, record in task_records(store)):
        return run_queue(store, timeout=args.timeout, ask=ask, review=review, mode=mode,
                         bell=bell, allow_red_base=args.allow_red_base)
    return run_loop(store, task, args.timeout, args.resume, ask=ask, reset=args.reset,
                    review=review, mode=mode, bell=bell,
                    allow_red_base=args.allow_red_base)


def cmd_hq(args, root):
    store = Store(root).require()
    report_orphaned_checks(store)
    resume = True if getattr(args, "resume", False) else None
    with OrchestratorLock(store, "ferrus hq") as held:
        front = hq_front_end(store, resume, getattr(args, "no_tui", False))
        for note in held.notes:
            front.write(note)
        # getattr: plain `ferrus` runs cmd_hq with the top-level options, which have no --web.
        board = start_web_beside(store, args.web_host, args.web_port, front.write,
                                 args.web_tls_cert, args.web_tls_key,
                                 args.web_allow_host) if getattr(args, "web", False) else None
        try:
            return front.run()
        finally:
            if board is not None:
                board.close()


# -- `ferrus pipeline …` and HQ's `/pipeline …` ------------------------------------------------
#
# One implementation for both front ends: pipeline_command() does the work and
# reports through ``out``; only following a run differs (the CLI drives it in
# the foreground, HQ in a background thread so HQ keeps reacting).

def _follow_in_foreground(orchestrator, name):
    say("following run %s — Ctrl+C leaves its workers running" % name, flush=True)
    try:
        outcome = orchestrator.drive(name)
    except KeyboardInterrupt:
        say("\ninterrupted: the workers keep running and status.json is intact; "
              "`ferrus pipeline resume %s` continues" % name, flush=True)
        return 130
    return _pipeline_result(outcome, lambda text: say(text, flush=True))


# The pipeline subcommands that drive runs, and so need the orchestrator lock.
PIPELINE_DRIVING = ("run", "resume", "continue", "retry")


def cmd_pipeline(args, root):
    store = Store(root).require()
    out = lambda text: say(text, flush=True)     # noqa: E731
    if args.pipeline_command not in PIPELINE_DRIVING:
        return pipeline_command(store, args, out, _follow_in_foreground,
                                bell=terminal_bell(sys.stdout))
    with OrchestratorLock(store, "ferrus pipeline %s" % args.pipeline_command) as held:
        for note in held.notes:
            out(note)
        return pipeline_command(store, args, out, _follow_in_foreground,
                                bell=terminal_bell(sys.stdout))


def add_pipeline_parser(sub):
    """`ferrus pipeline …` on the top-level subparsers."""
    p = sub.add_parser("pipeline", help="file-driven multi-agent pipelines (workflows.json)")
    commands = p.add_subparsers(dest="pipeline_command", metavar="COMMAND")
    commands.required = True
    commands.add_parser("list", help="the pipelines workflows.json defines")
    commands.add_parser("init", help="write an example workflows.json (never overwrites)")
    c = commands.add_parser("run", help="start a run and drive it to delivery")
    c.add_argument("name", metavar="NAME", help="the pipeline")
    c.add_argument("topic", metavar="TOPIC", nargs="+", help="what the workers work on")
    c = commands.add_parser("status", help="one run's phases and workers, or every run")
    c.add_argument("ref", metavar="RUN", nargs="?", help="a run folder name (or unique prefix)")
    c.add_argument("--json", action="store_true", help="status.json / machine-readable rows")
    for name, what in (("resume", "drive a run again (after Ctrl+C, a crash or a reboot)"),
                       ("continue", "go on after pause_after or a capacity checkpoint"),
                       ("cancel", "stop a run's workers, mark it cancelled and archive it")):
        c = commands.add_parser(name, help=what)
        c.add_argument("ref", metavar="RUN", help="a run folder name (or unique prefix)")
    c = commands.add_parser("retry", help="run a failed worker again")
    c.add_argument("ref", metavar="RUN", help="a run folder name (or unique prefix)")
    c.add_argument("worker", metavar="WORKER", help="the worker's role")
    p.set_defaults(run=cmd_pipeline)


def cmd_serve(args, root):
    relay = os.environ.get(SANDBOX_RELAY_ENV)
    if relay:
        # Inside a task's sandbox .ferrus/ is hidden: the server runs outside, behind the
        # task's bridge, with the role and project the orchestrator chose.
        return relay_mcp_stdio(relay)
    return serve_stdio(root, args.role, args.agent_name, args.agent_index, args.session)


class CliParser(argparse.ArgumentParser):
    """argparse with a "did you mean" hint for a mistyped command, choice or option."""

    argv = ()       # the command line being parsed, to find the subcommand's options

    def error(self, message):
        self.print_usage(sys.stderr)
        text = "%s: error: %s\n" % (self.prog, message)
        suggestion = self._suggestion(message)
        if suggestion:
            text += "hint: did you mean %s?\n" % suggestion
        self.exit(2, text)

    def _suggestion(self, message):
        choice = re.search(r"invalid choice: '?([^'\s]*)'? \(choose from (.*)\)", message)
        if choice:
            return did_you_mean(choice.group(1), re.findall(r"[^',\s]+", choice.group(2)))
        if not message.startswith("unrecognized arguments:"):
            return None
        options = self._option_names()
        for word in message.split(":", 1)[1].split():
            if word.startswith("-"):
                found = did_you_mean(word.split("=", 1)[0], options)
                if found:
                    return found
        return None

    def _option_names(self):
        """This parser's options and those of the subcommand named on the command line."""
        names = [o for action in self._actions for o in action.option_strings]
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                command = next((word for word in CliParser.argv if word in action.choices), None)
                if command:
                    names += action.choices[command]._option_names()
        return names


def _add_init_parser(sub):
    p = sub.add_parser("init", help="create ferrus.toml, .ferrus/ and the skill files")
    p.add_argument("--agents-path", metavar="P", help="where skill files go (default .agents)")
    p.set_defaults(run=cmd_init)


def _add_status_parser(sub):
    p = sub.add_parser("status", help="where the task stands")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=cmd_status)


def _add_log_parser(sub):
    p = sub.add_parser("log", help="the journal of every transition")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new entries")
    p.add_argument("-n", type=int, default=None, metavar="N", help="only the last N entries")
    p.add_argument("--all", "-a", action="store_true",
                   help="also the bookkeeping entries (agent sessions, leases, heartbeats, "
                        "capacity checks that let work go on)")
    p.add_argument("--task", metavar="ID", help="only the entries about this task (a queue "
                                                 "task's id or its end; `current`)")
    p.set_defaults(run=cmd_log)


def _add_sessions_parser(sub):
    p = sub.add_parser("sessions", help="every agent session: role, agent, outcome, usage, log")
    p.add_argument("id", nargs="?", help="show this one session (an id or its prefix) in full")
    p.add_argument("--json", action="store_true", help="the records as JSON")
    p.add_argument("--task", metavar="ID", help="only this task's sessions (`current`: the "
                                                 "current task's)")
    p.add_argument("--pipeline", metavar="RUN", help="only this pipeline run's workers")
    p.add_argument("-n", type=int, default=None, metavar="N", help="only the last N sessions")
    p.set_defaults(run=cmd_sessions)


def _add_usage_parser(sub):
    p = sub.add_parser("usage", help="tokens and cost per task, pipeline run and agent")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--since", metavar="WHEN", help="only sessions started since WHEN: a "
                                                   "duration (24h, 7d) or a date (2026-05-01)")
    p.set_defaults(run=cmd_usage)


def _add_diff_parser(sub):
    p = sub.add_parser("diff", help="the task's changes since its base commit (git)")
    p.add_argument("--stat", action="store_true", help="only the files changed and their counts")
    p.add_argument("--json", action="store_true", help="the diff's data as one JSON object")
    p.add_argument("paths", nargs="*", metavar="PATH", help="only these files or folders")
    p.add_argument("--task", metavar="ID", help="a parallel task's diff, in its worktree")
    p.set_defaults(run=cmd_diff)


def _add_task_parser(sub):
    p = sub.add_parser("task", help="queue a task, cancel or retry one (parallel tasks)")
    commands = p.add_subparsers(dest="task_command", metavar="COMMAND")
    commands.required = True
    add = commands.add_parser("add", help="put a task in the queue `ferrus run` works through")
    add.add_argument("text", nargs="*", metavar="TEXT", help="the task, in words")
    add.add_argument("--file", metavar="F", help="the task from this file (- for stdin)")
    add.add_argument("--milestone", nargs=2, metavar=("SPEC", "ID"),
                     help="the task that implements this milestone of this spec")
    add.add_argument("--ready", metavar="SPEC",
                     help="one task for every ready milestone of this spec")
    add.add_argument("--agent", metavar="AGENT",
                     help="the executor agent for this task (default: [hq.executor])")
    add.add_argument("--race", metavar="N|AGENTS",
                     help="race attempts at the task side by side: N attempts by the "
                          "executor agent, or one per AGENT[:MODEL] of a comma-separated "
                          "list; the first merged wins, the others are cancelled")
    cancel = commands.add_parser("cancel", help="take a task out of the queue or stop it; its "
                                                "work is saved, then its worktree and branch "
                                                "are removed")
    cancel.add_argument("id", metavar="ID", help="the task's id (`ferrus tasks`)")
    cancel.add_argument("--yes", "-y", action="store_true",
                        help="do not ask before stopping a running task")
    cancel.add_argument("--discard", action="store_true",
                        help="drop the work in its worktree instead of saving it")
    retry = commands.add_parser("retry", help="queue a failed or cancelled task again; it "
                                              "goes on in its kept worktree")
    retry.add_argument("id", metavar="ID", help="the task's id (`ferrus tasks`)")
    p.set_defaults(run=cmd_task)


def _add_tasks_parser(sub):
    p = sub.add_parser("tasks", help="the task queue: id, state, agent, age, title (the "
                                     "queued and running tasks, and those that ended in "
                                     "the last day)")
    p.add_argument("--all", action="store_true",
                   help="every task the queue ever had, however long ago it ended")
    p.add_argument("--json", action="store_true",
                   help="one JSON object with the tasks listed (uncut titles), and how many "
                        "older ones were left out")
    p.set_defaults(run=cmd_tasks)


def _add_journal_parser(sub):
    p = sub.add_parser("journal", help="maintain the journal (events.jsonl)")
    commands = p.add_subparsers(dest="journal_command", metavar="COMMAND")
    commands.required = True
    commands.add_parser("rotate", help="move events.jsonl to events.jsonl.1 and start anew")
    p.set_defaults(run=cmd_journal)


def _add_reset_parser(sub):
    p = sub.add_parser("reset", help="return to Idle from any state (keeps the spec selection)")
    p.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    p.set_defaults(run=cmd_reset)


def _add_approve_parser(sub):
    p = sub.add_parser("approve", help="confirm the reviewer's approval ([hq] human_review)")
    p.add_argument("--yes", "-y", action="store_true",
                   help="approve without showing the summary and asking first")
    p.add_argument("--task", metavar="ID", help="the parallel task to approve (needed when "
                                                 "more than one waits)")
    p.set_defaults(run=cmd_approve)


def _add_reject_parser(sub):
    p = sub.add_parser("reject", help="send a task the reviewer approved back to the executor "
                                      "([hq] human_review)")
    p.add_argument("notes", nargs="*", metavar="NOTES", help="what must change (review notes)")
    p.add_argument("--file", "-F", metavar="F", help="read the notes from file F (- for stdin)")
    p.add_argument("--task", metavar="ID", help="the parallel task to send back (needed when "
                                                 "more than one waits)")
    p.set_defaults(run=cmd_reject)


def _add_doctor_parser(sub):
    p = sub.add_parser("doctor", help="check .ferrus/ for consistency and explain repairs")
    p.add_argument("--fix", action="store_true", help="apply the safe repairs")
    add_probe_option(p)
    p.set_defaults(run=cmd_doctor)


def _add_check_parser(sub):
    p = sub.add_parser("check", help="run the check gate ([checks] commands)")
    p.add_argument("--force", action="store_true",
                   help="run the checks in any state and change nothing")
    p.add_argument("--task", metavar="ID", help="a parallel task's checks, in its worktree")
    p.set_defaults(run=cmd_check)


def _add_register_parser(sub):
    p = sub.add_parser("register", help="configure agent CLIs to reach this ferrus")
    add_registration_options(p)
    p.set_defaults(run=cmd_register)


def _add_unregister_parser(sub):
    p = sub.add_parser("unregister", help="remove what register wrote")
    p.add_argument("--supervisor", action="store_true", help="only the supervisor role")
    p.add_argument("--executor", action="store_true", help="only the executor role")
    p.set_defaults(run=cmd_unregister)


def _add_agents_parser(sub):
    p = sub.add_parser("agents", help="each role's agent: installed, version, registered")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_probe_option(p)
    p.set_defaults(run=cmd_agents)


def _add_run_parser(sub):
    p = sub.add_parser("run", help="run the whole loop without a UI until Complete or Failed")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--task", metavar="TEXT", help="create this task (as the human)")
    group.add_argument("--task-file", metavar="F",
                       help="create the task from this file (- for stdin)")
    group.add_argument("--milestone", metavar="ID|next",
                       help="create the task from this spec milestone (id or marker), or the "
                            "next ready one; approving it ticks its box")
    p.add_argument("--until-done", action="store_true",
                   help="after each milestone, take the next ready one until none is left")
    p.add_argument("--parallel", type=int, metavar="N",
                   help="work the task queue (`ferrus task add`) N tasks at a time, each in "
                        "its own git worktree, merged when the checks pass on the result "
                        "(default: [parallel] max_tasks)")
    p.add_argument("--timeout", type=float, metavar="S", help="give up after S seconds (exit 3)")
    p.add_argument("--resume", action="store_true", help="continue the task in flight")
    p.add_argument("--reset", action="store_true",
                   help="replace a Failed task (without it, a Failed task is kept and the run "
                        "refuses)")
    p.add_argument("--allow-red-base", action="store_true",
                   help="start agents even when the checks already fail before the task "
                        "(the run tries them first and stops on a red base); the executor is "
                        "told which failed before it began")
    output = p.add_mutually_exclusive_group()
    output.add_argument("--quiet", "-q", action="store_true",
                        help="only transitions, verdicts, questions, problems and the end "
                             "(no tool calls, heartbeats or agent starts)")
    output.add_argument("--json", action="store_true",
                        help="one JSON object per event on stdout, for CI logs and programs "
                             "(never asks: a question ends the run with exit 4)")
    _add_web_beside_options(p)
    p.set_defaults(run=cmd_run)


def _add_hq_parser(sub):
    p = sub.add_parser("hq", help="the interactive orchestration shell (also: plain `ferrus`)")
    p.add_argument("--resume", action="store_true", help="resume a task in flight without asking")
    p.add_argument("--no-tui", action="store_true", help="plain lines instead of curses")
    _add_web_beside_options(p)
    p.set_defaults(run=cmd_hq)


def _add_web_beside_options(p):
    """--web and its --web-host, --web-port, ... on `ferrus run` and `ferrus hq`."""
    p.add_argument("--web", action="store_true",
                   help="serve the task board in a browser beside it (`ferrus web`), "
                        "and answer questions and approvals there")
    add_web_options(p, prefix="web-")


def _add_serve_parser(sub):
    p = sub.add_parser("serve", help="the MCP server on stdio (started by agents)")
    p.add_argument("--role", choices=ROLES, help="expose only this role's tools")
    p.add_argument("--agent-name", default="unknown", help="agent name in the agent id")
    p.add_argument("--agent-index", type=int, default=0, help="index in the agent id")
    p.add_argument("--session", metavar="ID",
                   help="the agent session this server works for (default: $%s, set by HQ); "
                        "leases name it" % SESSION_ENV)
    p.set_defaults(run=cmd_serve)


def _add_serve_host_parser(sub):
    """`ferrus serve-host SOCKET`: without help text, so it stays out of `ferrus --help`
    (ferrus starts it while it runs agents: server_host.py)."""
    p = sub.add_parser(SERVER_HOST_COMMAND, description="the server host ferrus starts "
                       "while it runs agents: their MCP servers, forked from it")
    p.add_argument("socket", help="the Unix socket to listen on")
    p.set_defaults(run=lambda args, root: host_sessions(args.socket, main))


# Each command's subparser, in the order `ferrus --help` lists them.
COMMAND_PARSERS = (
    ("init", _add_init_parser),
    ("status", _add_status_parser),
    ("log", _add_log_parser),
    ("sessions", _add_sessions_parser),
    ("usage", _add_usage_parser),
    ("diff", _add_diff_parser),
    ("task", _add_task_parser),
    ("tasks", _add_tasks_parser),
    ("journal", _add_journal_parser),
    ("reset", _add_reset_parser),
    ("approve", _add_approve_parser),
    ("reject", _add_reject_parser),
    ("doctor", _add_doctor_parser),
    ("check", _add_check_parser),
    ("register", _add_register_parser),
    ("unregister", _add_unregister_parser),
    ("agents", _add_agents_parser),
    ("run", _add_run_parser),
    ("hq", _add_hq_parser),
    ("web", add_web_parser),
    ("pipeline", add_pipeline_parser),
    ("memory", add_memory_parser),
    ("spec", add_spec_parser),
    ("graph", add_graph_parser),
    ("places", add_places_parser),
    ("serve", _add_serve_parser),
    ("nano", add_nano_parser),        # no help text: ferrus starts it, --help leaves it out
    (SERVER_HOST_COMMAND, _add_serve_host_parser),      # the same
)


def build_parser(command=None):
    """The argument parser; with ``command`` (a known command's name) only that command's
    subparser is built — a command run from the shell pays for its own options, not for
    every command's."""
    parser = CliParser(
        prog="ferrus", description="Deterministic Supervisor → Executor → Reviewer orchestration "
                                   "of coding agents.")
    parser.add_argument("--version", action="version", version="ferrus %s" % __version__)
    parser.add_argument("-C", dest="directory", metavar="DIR",
                        help="run as if started in DIR (the project root)")
    parser.add_argument("--debug", action="store_true", help="debug logging on stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = [add for name, add in COMMAND_PARSERS if name == command]
    for add in chosen or [add for _, add in COMMAND_PARSERS]:
        add(sub)
    return parser


def setup_logging(debug=False):
    level_name = "debug" if debug else os.environ.get("FERRUS_LOG", "warning").lower()
    level = getattr(logging, level_name.upper(), logging.WARNING)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("ferrus: %(levelname)s: %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(level)
    log.propagate = False


def find_project_root(start):
    """The nearest folder from ``start`` upwards that holds .ferrus/ or ferrus.toml (as git
    finds .git), so every command works from a subdirectory; ``start`` when none does."""
    folder = start
    while True:
        if (os.path.isdir(os.path.join(folder, FERRUS_DIR))
                or os.path.isfile(os.path.join(folder, CONFIG_FILE))):
            return folder
        parent = os.path.dirname(folder)
        if parent == folder:
            return start
        folder = parent


def main(argv=None):
    """The command line: returns the exit code.  Ctrl+C at any point of it exits 130
    without a traceback (what it interrupted cleans up on the way out)."""
    if threading.current_thread() is threading.main_thread():
        starting = signal.getsignal(signal.SIGINT)
        if getattr(starting, "ferrus_startup", False):
            signal.signal(signal.SIGINT, signal.default_int_handler)
            if getattr(starting, "interrupted", False):
                return 130
    try:
        return _main(argv)
    except KeyboardInterrupt as interrupt:
        return getattr(interrupt, "exit_code", 130)


def _main(argv):
    CliParser.argv = tuple(sys.argv[1:] if argv is None else argv)
    parser = build_parser(command_word(CliParser.argv))
    args = parser.parse_args(argv)
    debug = args.debug or os.environ.get("FERRUS_DEBUG") == "1"
    setup_logging(debug)
    start = os.path.abspath(args.directory or os.getcwd())
    if args.directory is not None and not os.path.isdir(start):
        say("ferrus: -C %s: %s" % (args.directory, "not a directory" if os.path.exists(start)
                                   else "no such directory"), file=sys.stderr)
        say("hint: pass the project's folder, e.g. `ferrus -C path/to/project status`",
            file=sys.stderr)
        return 2
    # `init` creates a project right here; every other command finds the enclosing one.
    root = start if args.command == "init" else find_project_root(start)
    if not getattr(args, "run", None):
        if not os.path.isdir(os.path.join(root, FERRUS_DIR)):
            build_parser().print_help()
            return 0
        args.run, args.resume = cmd_hq, False

    try:
        return args.run(args, root)
    except FerrusError as err:
        if debug:
            raise
        say("ferrus: %s" % err.message, file=sys.stderr)
        if err.hint:
            say("hint: %s" % err.hint, file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt as interrupt:
        return getattr(interrupt, "exit_code", 130)
    except BrokenPipeError:
        return 1
    except OSError as err:
        if debug:
            raise
        # A full disk or a read-only file: the atomic writes left the old state intact.
        where = " (%s)" % err.filename if err.filename else ""
        say("ferrus: %s%s" % (err.strerror or err, where), file=sys.stderr)
        # Never "nothing was changed": a command may fail after an earlier write landed.
        say("hint: each file in .ferrus/ is replaced whole, so it holds its old or its new "
            "content; free space or fix permissions, check with `ferrus status` and "
            "`ferrus doctor`, and try again", file=sys.stderr)
        return 1

