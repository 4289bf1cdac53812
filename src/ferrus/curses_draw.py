"""HQ's curses screen, drawn: status, board, transcript, dialogs.

Status lines, task board, transcript, input line, dialogs."""

import contextlib
import os
import time

from .basics import FerrusError, format_duration, parse_timestamp, terminal_safe
from .task_machine import ACTIVE_STATES
from .session_machine import SS
from .gates import phase_words
from .store import read_task_record
from .specs import spec_display_name
from .operations import short_task_id
from .task_queue import task_state_word
from .sessions import compact_count, count_tool_calls, task_usage
from .hq_board import HQ_COMMANDS


_CURSES_COLORS = {"transition": "CYAN", "warning": "YELLOW", "error": "RED",
                  "question": "MAGENTA", "agent": "GREEN",
                  "diff+": "GREEN", "diff-": "RED", "diff@": "CYAN",
                  "Executing": "CYAN", "Addressing": "YELLOW", "Consultation": "MAGENTA",
                  "AwaitingHuman": "YELLOW", "AwaitingConfirmation": "YELLOW",
                  "Reviewing": "BLUE", "Complete": "GREEN",
                  "Failed": "RED", "Integrating": "BLUE", "merged": "GREEN", "failed": "RED"}
_CURSES_KEYS_HELP = ("Enter send · Alt+Enter/Ctrl+J newline · Tab complete · ↑↓ history · "
                     "PgUp/PgDn scroll · Ctrl+C twice quits")


def fit_banner(text, width):
    """``text`` in ``width`` columns for the one-row dialog banner: too long, its middle
    gives way to "…", as its end holds the question and the keys that answer it."""
    if len(text) <= width:
        return text
    if width < 2:
        return text[-width:] if width > 0 else ""
    head = width // 3
    return text[:head] + "…" + text[len(text) - (width - head - 1):]


class CursesDrawing:
    """What the curses front end draws: the status lines, the task board, the
    transcript, the input line and modal dialogs, fitted to the terminal."""

    def _setup_colors(self):
        curses = self.curses
        for kind in ("question", "error", "input"):
            self.attrs[kind] = curses.A_BOLD
        if not curses.has_colors():
            return
        background, pairs = -1, {}
        try:
            curses.use_default_colors()      # keep the terminal's own colours
        except curses.error:
            background = curses.COLOR_BLACK
        if os.environ.get("NO_COLOR"):
            return
        for key, name in _CURSES_COLORS.items():
            if name not in pairs:
                pairs[name] = len(pairs) + 1
                curses.init_pair(pairs[name], getattr(curses, "COLOR_" + name), background)
            self.attrs[key] |= curses.color_pair(pairs[name])

    def status_lines(self):
        """(state, the state line, the agents line): times, counters against their limits,
        spec and milestone; then each slot's session state.  Of the attached task when
        there is one; while parallel tasks run unattached, how many do what."""
        store, controller = self.store, self.controller
        if self.attached:
            store, controller = self.store.for_task(self.attached), \
                self.task_controller(self.attached)
            if not store.exists():
                record = read_task_record(self.store.dir, self.attached)
                return "", "ferrus HQ │ task %s %s │ /attach alone returns to every task" % (
                    short_task_id(self.attached), record.get("status", "gone")), ""
        try:
            data, now = store.read_state(), self.store.clock()
        except FerrusError as err:
            return "", "ferrus HQ │ state unreadable: %s" % err, ""
        if not self.attached and self.controller.mirrors_parallel_task(data):
            runner = self.runner
            return "", "ferrus HQ │ tasks: %s │ /attach ID follows one" % (
                self.board.summary() or "none"), \
                "run: %s, %d at a time" % (phase_words(runner.machine.phase),
                                           runner.max_tasks) if runner is not None else \
                "run: waiting for queued tasks, %d at a time" % self.run_width \
                if self.run_width else "no run: /run works the queue"
        retries = cycles = "?"
        with contextlib.suppress(FerrusError):
            limits = self.store.config().limits
            retries, cycles = limits.max_check_retries, limits.max_review_cycles

        def since(stamp):
            with contextlib.suppress(ValueError, TypeError):
                return format_duration((now - parse_timestamp(stamp)).total_seconds())
            return "-"
        parts = ["ferrus HQ", "%s %s" % (data.state, since(data.state_entered_at))]
        if data.state in ACTIVE_STATES and data.task_started_at:
            parts.append("task %s" % since(data.task_started_at))
        parts += ["retries %d/%s" % (data.check_retries, retries),
                  "reviews %d/%s" % (data.review_cycles, cycles)]
        if data.selected_spec:
            parts.append("spec %s · %s" % (spec_display_name(data.selected_spec),
                                           data.selected_milestone or "none left"))
        if controller is not None and controller.paused and data.state in ACTIVE_STATES:
            parts.append("PAUSED (/resume)")
        if controller is not None and controller.checkpoint:
            parts.append("CAPACITY CHECKPOINT (/continue)")
        if data.task_id:
            used = task_usage(self.store, data.task_id)
            if used["sessions"]:
                parts.append("%s tok%s" % (
                    compact_count(used["input_tokens"] + used["output_tokens"]),
                    " $%.2f%s" % (used["cost_usd"], "+?" if used["cost_unknown"] else "")
                    if used["cost_usd"] is not None else ""))
        if self.attached:            # right after its state, where a narrow screen keeps it
            parts.insert(2, "▸%s" % short_task_id(self.attached))
        slots = ["%s %s%s" % (slot.name, slot.label(),
                              " (%s)" % count_tool_calls(controller.tool_calls_of(slot))
                              if slot.session.state in (SS.RUNNING, SS.INTERRUPTING) else "")
                 for slot in (controller.slots.values() if controller is not None else ())]
        return data.state.value, " │ ".join(parts), " · ".join(slots) if controller is not None \
            else "no agent of this task runs here (/run resumes it)"

    def board_rows(self, height, width):
        """The task board's screen rows, (text, attr): a header, then one row per task,
        as many as fit in about half of what is left of the screen."""
        rows = self.board.rows()
        if not rows:
            return []
        room = max(2, min(12, (height - 8) // 2))
        shown = rows if len(rows) <= room else rows[:room - 1]
        out = [("tasks: %s — /tasks lists them, /attach ID follows one" % self.board.summary(rows),
                self.curses.A_BOLD)]
        for row in shown:
            out.append((self.board.line(row, width, self.attached),
                        self.attrs[task_state_word(row)] |
                        (self.curses.A_BOLD if row["id"] == self.attached else 0)))
        if len(shown) < len(rows):
            out.append(("  … %d more (/tasks)" % (len(rows) - len(shown)), self.curses.A_DIM))
        return out

    def _tail(self, entries, height, width):
        """The screen rows of the newest entries, ``self.scroll`` rows back from the end."""
        import textwrap
        rows = []
        for kind, line, *_ in reversed(entries):
            wrapped = (textwrap.wrap(line, width, subsequent_indent="  ", drop_whitespace=False)
                       if width > 8 else [line[:max(1, width)]]) or [""]
            rows.extend((kind, row) for row in reversed(wrapped))
            if len(rows) >= height + self.scroll:
                break
        self.scroll = max(0, min(self.scroll, len(rows) - height))
        return list(reversed(rows[self.scroll:self.scroll + height]))

    def _input_rows(self, width):
        """The input as screen rows ("> " first, then indented) and the cursor's row/col."""
        rows, where, offset, span = [], (0, 2), 0, max(1, width - 2)
        for number, line in enumerate(self.buffer.split("\n")):
            for start in range(0, max(len(line), 1), span):
                chunk = line[start:start + span]
                if offset + start <= self.cursor <= offset + start + len(chunk):
                    where = (len(rows), 2 + self.cursor - offset - start)
                rows.append(("> " if number == 0 and start == 0 else "  ") + chunk)
            offset += len(line) + 1
        return rows, where

    def hint(self):
        if self.notice and time.monotonic() < self.notice_until:
            return self.notice
        if self.completion:
            options, index = self.completion[:2]
            return "  ".join("[%s]" % o if i == index else o for i, o in enumerate(options))
        if self.scroll:
            return "scrolled back %d lines — PgDn returns" % self.scroll
        typed = self.buffer.split()
        # The longest command the input starts with: "/task add …" is not "/task …".
        return next(("%s — %s" % (("%s %s" % (command, args)).strip(), what)
                     for command, args, what in sorted(HQ_COMMANDS, key=lambda c: -len(c[0]))
                     if typed[:len(command.split())] == command.split()),
                    _CURSES_KEYS_HELP)

    def put(self, row, col, text, attr=0):
        with contextlib.suppress(self.curses.error):    # writing the last cell "fails"
            self.scr.addnstr(row, col, terminal_safe(text), max(0, self.scr.getmaxyx()[1] - col),
                             attr)

    def draw(self):
        curses = self.curses
        height, width = self.scr.getmaxyx()
        if time.monotonic() >= self.status_due:      # about once a second
            self.status, self.status_due = self.status_lines(), time.monotonic() + 1.0
        state, line, agents = self.status
        rows, (cursor_row, cursor_col) = self._input_rows(width)
        keep = max(1, min(len(rows), height // 3))
        first = max(0, min(cursor_row - keep + 1, len(rows) - keep))
        # The task board goes above the transcript: at 80 columns a side pane would leave
        # neither the board's rows nor the transcript's lines room enough to read.
        board = self.board_rows(height, width) if height >= 12 else []
        top, bottom = 2 + len(board), height - keep - 1   # the transcript's rows; the hint
        self.scr.erase()
        self.put(0, 0, line.ljust(width), curses.A_REVERSE)
        self.put(0, len("ferrus HQ │ "), state, curses.A_REVERSE | self.attrs[state])
        if self.banner:                              # dialogs ask in the status area
            self.put(1, 0, fit_banner(self.banner, width).ljust(width),
                     curses.A_BOLD | self.attrs["question"])
        else:
            self.put(1, 0, agents)
        for i, (text, attr) in enumerate(board):
            self.put(2 + i, 0, text, attr)
        if self.selected is not None:                # a selection dialog
            size = max(1, bottom - top)
            first_option = max(0, min(self.selected - size // 2, len(self.view) - size))
            for i, option in enumerate(self.view[first_option:first_option + size]):
                self.put(top + i, 0, option.ljust(width),
                         curses.A_REVERSE if first_option + i == self.selected else 0)
        else:
            entries = self.transcript if self.view is None else [
                line if isinstance(line, tuple) else ("agent", line) for line in self.view]
            if self.view is None and self.attached:  # one task's lines, and HQ's own
                entries = [entry for entry in entries if entry[2] in (None, self.attached)
                           or entry[0] == "question"]
            for i, (kind, text) in enumerate(self._tail(entries, bottom - top, width)):
                self.put(top + i, 0, text, self.attrs[kind])
        self.put(bottom, 0, self.hint(), curses.A_DIM)
        for i, row in enumerate(rows[first:first + keep]):
            self.put(bottom + 1 + i, 0, row)
        with contextlib.suppress(curses.error):
            self.scr.move(bottom + 1 + cursor_row - first, min(cursor_col, width - 1))
        self.scr.refresh()
        if self.bell_due:
            self.bell_due = False
            with contextlib.suppress(curses.error):
                curses.beep()

    def _modal(self, banner, react):
        """Poll and draw until ``react(key)`` returns something other than ``...``; None
        if HQ is told to quit meanwhile."""
        self.banner = banner
        try:
            while not self.done:
                self.poll()
                self.draw()
                key = self.getkey(50)
                result = ... if key is None else react(key)
                if result is not ...:
                    return result
            return None
        finally:
            self.banner = None
