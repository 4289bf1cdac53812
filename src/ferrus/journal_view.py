"""HQ's journal view: entries, checks, notifications, heartbeats.

The controller reads the journal in order, so no transition is ever missed; this
part turns entries into HqMessages for whichever front end prints them."""

import contextlib
import time

from .basics import FerrusError, format_duration
from .task_machine import S
from .session_machine import EMERGENCY_STOP
from .mcp import tool_calls_for_session
from .agents import tool_denied, tool_display_name, tool_failure_line, tool_line
from .sessions import HqMessage, check_log_tail, first_lines, running_check_commands


class JournalView:
    """What HQ's controller shows of the journal: each new entry as messages, check
    results with their output, notifications, a heartbeat when nothing happens."""

    def drain_journal(self):
        entries, self.journal_offset = self.store.journal_since(self.journal_offset,
                                                                after_seq=self.cursor)
        for entry in entries:
            if entry["seq"] > self.cursor:
                self.cursor = entry["seq"]
                if self.store.task is not None and entry.get("task_id") != self.store.task \
                        or self._of_parallel_task(entry.get("task_id")):
                    continue            # another parallel task's: its own controller shows it
                # Complete is reached by the reviewer's approve, or by the human's
                # confirmation when [hq] human_review is on.
                if entry.get("to") == S.COMPLETE.value and entry.get("from") != S.COMPLETE.value \
                        and entry["seq"] > self.start_seq:
                    self.tasks_completed += 1
                self._show_entry(entry)

    def catch_up(self, rev, patience=1.0):
        """Show journal entries up to ``rev``.  STATE.json is written just before its
        journal line, so a state read can be a moment ahead of the journal."""
        self.drain_journal()
        if self.cursor >= rev or rev == self._missing_rev:
            return
        deadline = time.monotonic() + patience
        while self.cursor < rev and time.monotonic() < deadline:
            time.sleep(0.005)
            self.drain_journal()
        if self.cursor < rev:
            # A crash left STATE.json ahead of the journal; doctor (or the next
            # commit) fills the gap.  Do not wait for it on every poll.
            self._missing_rev = rev

    def _show_entry(self, entry):
        event = entry.get("event")
        self._notify_for(entry)
        if event in ("heartbeat", "claim") or entry.get("actor") in ("hq", "pipeline"):
            return
        if event in ("check_passed", "check_failed", "submit"):
            self._show_checks(entry)
        if entry.get("from") != entry.get("to"):
            self.emit(HqMessage("transition", "%s → %s  (%s by %s)" % (
                entry.get("from"), entry.get("to"), event, entry.get("actor")), "transition",
                {"from": entry.get("from"), "to": entry.get("to"), "by": event,
                 "actor": entry.get("actor"), "task_id": entry.get("task_id"),
                 "seq": entry.get("seq")}))
        # What the agents said, from the content files the entry wrote (still current:
        # HQ reads each entry within moments of its commit).
        shown = {"submit": ("SUBMISSION.md", "submission", "submission", 4),
                 "reject": ("REVIEW.md", "review", "review notes", 8),
                 "human_reject": ("REVIEW.md", "review", "the human's review notes", 8),
                 "consult": ("CONSULT_REQUEST.md", "consult", "consultation", 8),
                 "respond_consult": ("CONSULT_RESPONSE.md", "consult_answer",
                                     "the supervisor answers", 8),
                 "answer": ("ANSWER.md", "answer", "answered", 4)}.get(event)
        if shown is not None:
            name, kind, title, count = shown
            said = (entry.get("detail") or {}).get("said")
            lines = [str(line) for line in said] if isinstance(said, list) and said else \
                first_lines(self.store.read_file(name), count)
            if lines:
                key = {"submission": "summary", "review": "notes", "consult": "question"}.get(
                    kind, "answer")
                self.emit(HqMessage("info", "%s:\n  %s" % (title, "\n  ".join(lines)), kind,
                                    {key: "\n".join(lines), "task_id": entry.get("task_id")}))

    def _show_checks(self, entry):
        """One line per check command (the failing ones with their last lines), then the
        gate's verdict, from the entry's detail."""
        detail = entry.get("detail") or {}
        checks = [c for c in detail.get("checks") or [] if isinstance(c, dict)]
        if not checks:
            return
        for check in checks:
            passed = check.get("status") == "passed"
            tail = [] if passed else check_log_tail(self.store, check.get("log"))
            secs = check.get("secs") if isinstance(check.get("secs"), (int, float)) else 0
            took = format_duration(secs) if secs >= 1 else "%.1fs" % secs
            if check.get("status") == "failed" and check.get("exit") is not None:
                took = "exit %s, %s" % (check.get("exit"), took)
            text = "check %s: %s (%s)" % (check.get("status"), check.get("command"), took)
            if tail:
                text += "\n" + "\n".join("    │ " + line for line in tail)
            self.emit(HqMessage("info" if passed else "warning", text, "check",
                                dict(check, tail=tail)))
        passed = entry.get("event") != "check_failed"
        during = "submit" if entry.get("event") == "submit" or \
            detail.get("during") == "submit" else "check"
        if passed:
            text = "checks passed" + (" — submitting for review" if during == "submit" else "")
        else:
            text = "checks failed%s (retry %s); full log %s" % (
                " on submit" if during == "submit" else "", detail.get("retries", "?"),
                detail.get("log"))
        self.emit(HqMessage("info" if passed else "warning", text, "checks", {
            "passed": passed, "during": during, "retries": detail.get("retries"),
            "log": detail.get("log"), "task_id": entry.get("task_id")}))

    def _notify_for(self, entry):
        """The journal entries worth a notification ([notify] picks which)."""
        event, detail, task = entry.get("event"), entry.get("detail") or {}, entry.get("task_id")
        if entry.get("actor") == "pipeline":
            return                      # the pipeline orchestrator announces its own
        if entry.get("to") == S.FAILED.value and entry.get("from") != S.FAILED.value:
            reason = self.store.read_state().failure_reason or event
            self.notifier.notify("failed", task, reason.splitlines()[0] if reason else "")
            return
        if event == "capacity_checkpoint":
            action = detail.get("action")
            self.notifier.notify("emergency_stop" if action == EMERGENCY_STOP else "checkpoint",
                                 task, "capacity %s before %s" % (action, detail.get("target")))
            return
        sources = {"create_task": ("task_created", "TASK.md"),
                   "submit": ("submitted", "SUBMISSION.md"), "reject": ("rejected", "REVIEW.md"),
                   "ask_human": ("awaiting_human", "QUESTION.md"),
                   "approve": ("complete", "TASK.md"), "human_approve": ("complete", "TASK.md"),
                   "human_reject": ("rejected", "REVIEW.md")}
        if event in ("approve", "human_approve") and entry.get("to") == S.INTEGRATING.value:
            return       # a parallel task is complete once merged: its runner announces it
        if event == "approve" and entry.get("to") == S.AWAITING_CONFIRMATION.value:
            # [hq] human_review: the reviewer approved and the human must confirm.
            self.notifier.notify("awaiting_human", task, "the reviewer approved; confirm with "
                                 "`ferrus approve` or send it back with `ferrus reject NOTES`")
            return
        if event in sources:
            name, source = sources[event]
            lines = first_lines(self.store.read_file(source), 1, 200)
            self.notifier.notify(name, task, lines[0] if lines else "")

    def _watch_checks(self):
        """A check command that starts is shown at once (its result comes with the
        journal entry); its pid file in .ferrus/check-processes/ says it runs."""
        now = self.clock()
        if now < self._next_check_scan or self.mirrored:
            return                    # a parallel task's checks are its controller's
        self._next_check_scan = now + self.CHECK_SCAN_EVERY
        running = running_check_commands(self.store)
        for check_id, command in running.items():
            if check_id not in self.checks_seen:
                self.checks_seen[check_id] = (command, now)
                self.emit(HqMessage("info", "check running: %s" % command, "check_started",
                                    {"command": command}))
        for check_id in [c for c in self.checks_seen if c not in running]:
            del self.checks_seen[check_id]

    def _heartbeat(self):
        now = self.clock()
        if now - self.last_activity < self.HEARTBEAT_SECS:
            return
        running = [slot for slot in self.slots.values()
                   if slot.process is not None and slot.started_at is not None]
        if not running:
            self.last_activity = now
            return
        for slot in running:
            calls = self.tool_calls_of(slot)
            secs = now - slot.started_at
            text = "%s working, %s, %d tool call%s" % (slot.name, format_duration(secs), calls,
                                                      "" if calls == 1 else "s")
            checks = ["%s (%s)" % (command, format_duration(now - since))
                      for command, since in self.checks_seen.values()]
            if checks:
                text += "; check running: " + ", ".join(checks)
            said = slot.process.last_text
            if said:
                text += "; last output: " + (said if len(said) <= 100 else said[:99] + "…")
            self.emit(HqMessage("agent", text, "heartbeat", {
                "slot": slot.name, "secs": round(secs, 1), "tool_calls": calls,
                "checks_running": [c for c, _ in self.checks_seen.values()],
                "last_output": said}))

    def tool_calls_of(self, slot):
        """The running session's tool calls: from its own streamed output, or, for an
        agent that streams nothing ferrus reads, its ferrus tool calls (counted by the
        MCP servers it started, which carry its session id — not the task's calls since
        it started, which would include an agent running beside it)."""
        mcp = 0
        with contextlib.suppress(FerrusError, OSError):
            mcp = tool_calls_for_session(self.store, slot.session_id,
                                         self.store.read_state().task_id)
        return max(slot.tool_calls, mcp, 0)

    def _show_tool_calls(self, slot):
        """One compact line per tool call the agent's streamed output reported, and one
        more for each that failed or was denied, with why."""
        if slot.process is None:
            return
        events = slot.process.events[slot.events_shown:]
        slot.events_shown += len(events)
        # Paths are shortened against where the task's code is (a parallel task's
        # worktree), so a path into the project's own checkout shows as the agent gave it.
        folder = self.store.workdir
        for event in events:
            if event.kind == "tool_call":
                line = tool_line(slot.name, event.name, event.text, folder)
                slot.calls_by_id[event.call_id] = (event.name, event.text)
                self.emit(HqMessage("agent", line, "tool_call", {
                    "slot": slot.name, "tool": tool_display_name(event.name),
                    "input": event.text, "ok": event.ok}))
            elif event.kind == "tool_result" and event.ok is False:
                name, summary = slot.calls_by_id.pop(event.call_id, (event.name, ""))
                line = tool_failure_line(slot.name, name, event.text, folder)
                self.emit(HqMessage("agent", line, "tool_failed", {
                    "slot": slot.name, "tool": tool_display_name(name), "input": summary,
                    "reason": event.text, "denied": tool_denied(event.text)}))
            elif event.kind == "tool_result":
                slot.calls_by_id.pop(event.call_id, None)
