"""HQ in curses: keys, line editing, history, completion.

HqShell's commands in a full-screen terminal: two status lines on top, the transcript
in the middle, a hint line and the input at the bottom (drawn by CursesDrawing).
curses is imported inside functions because Windows Python has no curses module."""

import collections
import contextlib
import os
import re
import signal
import sys
import time

from .basics import FerrusError, UsageError, __version__, terminal_safe
from .system import read_text
from .specs import list_spec_paths, parse_spec
from .operations import HUMAN, ROLES, op_select_milestone, short_task_id
from .hq_board import HQ_COMMANDS, _diff_line_kind
from .hq_shell import HqShell
from .curses_draw import CursesDrawing


HISTORY_FILE = "~/.ferrus_history"
HISTORY_KEEP = 1000


def _line_edits(curses):
    """Keys that only edit the input: key -> (buffer, cursor) -> (buffer, cursor)."""
    back = lambda b, c: (b[:max(0, c - 1)] + b[c:], c - 1)           # noqa: E731
    delete = lambda b, c: (b[:c] + b[c + 1:], c)                        # noqa: E731
    home, end = (lambda b, c: (b, 0)), (lambda b, c: (b, len(b)))
    return {curses.KEY_BACKSPACE: back, "\x7f": back, "\x08": back,
            curses.KEY_DC: delete, "\x04": delete, curses.KEY_HOME: home, "\x01": home,
            curses.KEY_END: end, "\x05": end,
            curses.KEY_LEFT: lambda b, c: (b, c - 1), curses.KEY_RIGHT: lambda b, c: (b, c + 1),
            "\x15": lambda b, c: (b[c:], 0),                      # Ctrl+U: cut before
            "\x0b": lambda b, c: (b[:c], c),                      # Ctrl+K: cut after
            "\n": lambda b, c: (b[:c] + "\n" + b[c:], c + 1)}     # Ctrl+J: a newline


class CursesHq(CursesDrawing, HqShell):
    """HQ in curses.  Only HqShell's terminal parts are replaced; ``handle`` and the
    ``cmd_*`` methods are shared, so both front ends behave the same."""

    def __init__(self, store, resume=None, clock=time.monotonic, history_path=None):
        super().__init__(store, resume=resume, clock=clock)
        self.scr = self.curses = None
        self.transcript = collections.deque(maxlen=10000)   # (kind, one line)
        self.scroll = 0              # screen rows scrolled back from the newest
        self.buffer, self.cursor = "", 0
        self.history_path = os.path.expanduser(history_path or HISTORY_FILE)
        self.history = self._load_history()
        self.history_pos, self.draft = len(self.history), ""
        self.completion = None       # (candidates, index, text before the word, text after)
        self.banner = None           # a y/n question, dialog title or attach notice
        self.view = self.selected = None     # lines shown instead of the transcript
        self.notice, self.notice_until, self.last_ctrl_c = None, 0.0, 0.0
        self.status, self.status_due = ("", "", ""), 0.0
        self.attrs = collections.defaultdict(int)
        self.bell_due = False        # rung at the next draw, from the thread that draws

    def ring_bell(self):
        self.bell_due = True

    # -- output --------------------------------------------------------------------------

    def show(self, message):
        if self.held is not None:            # an interactive agent has the terminal
            self.held.append(message)
            return
        stamp = time.strftime("%H:%M:%S ")
        # Every line is kept with its task: /attach ID shows one task's, and detaching
        # brings the others back.
        task = message.data.get("task_id") if isinstance(message.data, dict) else None
        if message.kind == "question":
            self.add("question", "%s[AWAITING YOUR ANSWER]\n%s\nType your answer and press "
                                 "Enter." % (stamp, message.text))
        elif message.kind == "confirm":
            self.add("question", "%s[AWAITING YOUR CONFIRMATION]\n%s" % (stamp, message.text))
        else:
            prefix = {"warning": "warning: ", "error": "error: ", "agent": "• "}
            self.add(message.kind, stamp + prefix.get(message.kind, "") + message.text, task)
        self.status_due = 0                  # a message usually means the state moved

    def write(self, text):
        self.add("error" if text.startswith("error:") else "output", text)

    def add(self, kind, text, task=None):
        for line in terminal_safe(text).expandtabs().split("\n"):
            self.transcript.append((kind, line, task))
            if self.scroll and (self.attached is None or task in (None, self.attached)):
                self.scroll += 1             # a scrolled-back view stays where it is

    # -- the loop ------------------------------------------------------------------------

    def run(self):
        import curses
        self.curses = curses
        os.environ.setdefault("ESCDELAY", "25")          # a lone Esc should not lag
        # SIGTERM/SIGHUP only set a flag: the loop ends and the terminal is restored.
        previous = {sig: signal.signal(sig, lambda *_: setattr(self, "done", True))
                    for sig in (getattr(signal, n, None) for n in ("SIGTERM", "SIGHUP")) if sig}
        try:
            return curses.wrapper(self._main)    # endwin() whatever happens, then re-raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.shutdown()

    def _main(self, scr):
        curses = self.curses
        self.scr, self.edits = scr, _line_edits(curses)
        curses.raw()        # Ctrl+C arrives as a key, never as KeyboardInterrupt mid-poll
        curses.nonl()       # so that Enter (\r) and Ctrl+J (\n) differ
        with contextlib.suppress(curses.error):
            curses.curs_set(1)
        self._setup_colors()
        self.write("ferrus HQ %s — /help lists the commands, Ctrl+C twice quits." % __version__)
        self.write(self.controller.describe_state())
        data = self.controller.task_in_flight()
        if data is not None:
            self.controller.paused = True    # no agent starts while the question is open
            self.controller.paused = not (self.resume if self.resume is not None else
                                          self.confirm("A task is in flight (%s). Resume it?"
                                                       % data.state))
            self.write("Not resuming; /resume continues the task later."
                       if self.controller.paused else "Resuming it.")
        try:
            self.parallel_tasks_in_flight()
        except FerrusError as err:
            self.write("error: %s" % err.full_text())
        while not self.done:
            self.poll()                      # reactions go on while the user types
            self.draw()
            key = self.getkey(50)
            while key is not None and not self.done:     # pasted text: take it all at once
                self.on_key(key)
                key = self.getkey(0)
        return 0

    def getkey(self, timeout_ms):
        """One key (str or curses key code), or None if none came within the timeout."""
        self.scr.timeout(timeout_ms)
        try:
            return self.scr.get_wch()
        except self.curses.error:
            return None

    def on_key(self, key):
        curses = self.curses
        if self.completion and key not in ("\t", curses.KEY_BTAB, "\r", curses.KEY_ENTER,
                                           "\x1b"):
            self.completion = None           # typing goes on from the completed text
        if key == "\x1b":
            after = self.getkey(30)
            if after in ("\r", "\n"):        # Alt+Enter
                self.on_key("\n")
            elif after is None and self.completion:      # Esc: back to what was typed
                head, tail = self.completion[2:]
                self.buffer, self.cursor, self.completion = head + tail, len(head), None
            elif after is not None:
                self.on_key(after)           # Alt+key: as the key alone
        elif key in ("\r", curses.KEY_ENTER):
            if self.completion:
                self.completion = None       # Enter accepts the completion
            else:
                self.submit()
        elif key in self.edits:
            self.buffer, cursor = self.edits[key](self.buffer, self.cursor)
            self.cursor = max(0, min(len(self.buffer), cursor))
        elif key in ("\t", curses.KEY_BTAB):
            self.complete(-1 if key == curses.KEY_BTAB else 1)
        elif key == "\x03":
            self.ctrl_c()
        elif key in (curses.KEY_UP, curses.KEY_DOWN):
            self.browse(-1 if key == curses.KEY_UP else 1)
        elif key in (curses.KEY_PPAGE, curses.KEY_NPAGE):
            page = max(1, self.scr.getmaxyx()[0] // 2)
            self.scroll = max(0, self.scroll + (page if key == curses.KEY_PPAGE else -page))
        elif key == "\x0c":                  # Ctrl+L: repaint a garbled screen
            self.scr.clearok(True)
        elif isinstance(key, str) and key.isprintable():
            self.buffer = self.buffer[:self.cursor] + key + self.buffer[self.cursor:]
            self.cursor += 1

    def submit(self):
        text, self.buffer, self.cursor = self.buffer.strip(), "", 0
        self.history_pos, self.draft, self.scroll = len(self.history), "", 0
        if not text:
            return
        self.add("input", "> " + text.replace("\n", "\n  "))
        if text.startswith("/"):             # answers to agents stay out of the history
            self.remember(text)
        self.handle(text)
        self.status_due = 0

    def ctrl_c(self):
        now = time.monotonic()
        if now - self.last_ctrl_c > 2.0:
            self.buffer, self.cursor, self.last_ctrl_c = "", 0, now
            self.notice, self.notice_until = "Press Ctrl+C again to quit.", now + 2.0
            return
        self.last_ctrl_c = 0.0
        self.quit_unless_declined()

    # -- completion and history ----------------------------------------------------------

    def candidates(self, head, word):
        """Command names for the first word; slot or role names after some commands."""
        if not head:
            return [name for name, _, _ in HQ_COMMANDS if name.startswith(word)]
        tasks = tuple(short_task_id(row["id"]) for row in self.board.rows())
        words = {"/attach": tuple(self.controller.slots) + tasks,
                 "/tell": tuple(self.controller.slots), "/model": ROLES,
                 "/log": tasks, "/diff": tasks, "/status": tasks,
                 "/task": ("add", "cancel", "retry")}.get(head.split()[0], ()) \
            if head.count(" ") == 1 else ()
        return [w for w in words if w.startswith(word)]

    def complete(self, step):
        if self.completion:
            options, index, head, tail = self.completion
            index = (index + step) % len(options)
        else:
            before, tail = self.buffer[:self.cursor], self.buffer[self.cursor:]
            if not before.startswith("/") or "\n" in before:
                return
            head, _, word = before.rpartition(" ")
            head = head + " " if head else ""
            options = self.candidates(head, word)
            if not options:
                return
            index = 0 if step > 0 else len(options) - 1
        self.buffer, self.cursor = head + options[index] + tail, len(head + options[index])
        # One candidate completes at once; several cycle until Enter accepts one.
        self.completion = (options, index, head, tail) if len(options) > 1 else None

    def _load_history(self):
        try:
            with open(self.history_path, encoding="utf-8", errors="replace") as handle:
                lines = handle.read().splitlines()[-HISTORY_KEEP:]
        except OSError:
            return []
        # One entry a line; a multi-line command has its newlines escaped.
        return [re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), line)
                for line in lines if line.strip()]

    def remember(self, text):
        """Append a command to ~/.ferrus_history at once, so a crash loses nothing."""
        if self.history and self.history[-1] == text:
            return
        self.history.append(text)
        self.history_pos = len(self.history)
        with contextlib.suppress(OSError):
            fd = os.open(self.history_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            with open(fd, "a", encoding="utf-8") as handle:
                handle.write(text.replace("\\", "\\\\").replace("\n", "\\n") + "\n")

    def browse(self, step):
        if self.history_pos == len(self.history):
            self.draft = self.buffer         # what was being typed comes back at the end
        self.history_pos = min(len(self.history), max(0, self.history_pos + step))
        self.buffer = (self.history[self.history_pos] if self.history_pos < len(self.history)
                       else self.draft)
        self.cursor = len(self.buffer)

    # -- drawing -------------------------------------------------------------------------

    # -- dialogs -------------------------------------------------------------------------

    def confirm(self, question):
        answer = self._modal(question + "  [y/N]", lambda key: True if key in ("y", "Y") else
                             False if key in ("n", "N", "\r", "\n", "\x1b", "\x03") else ...)
        self.write("%s %s" % (question, "yes" if answer else "no"))
        return bool(answer)

    def select(self, title, options):
        """A list dialog: ↑/↓ move, Enter picks (the index), Esc cancels (None)."""
        curses = self.curses
        moves = {curses.KEY_UP: -1, curses.KEY_DOWN: 1, curses.KEY_PPAGE: -10,
                 curses.KEY_NPAGE: 10, curses.KEY_HOME: -len(options), curses.KEY_END: len(options)}

        def react(key):
            if key in moves:
                self.selected = max(0, min(len(options) - 1, self.selected + moves[key]))
                return ...
            return (self.selected if key in ("\r", "\n", curses.KEY_ENTER) else
                    None if key in ("\x1b", "\x03", "q") else ...)
        self.view, self.selected = list(options), 0
        try:
            return self._modal(title + "  (↑↓ move, Enter selects, Esc cancels)", react)
        finally:
            self.view = self.selected = None

    # -- commands that need the screen ---------------------------------------------------

    def cmd_milestones(self, rest):
        if rest:
            return super().cmd_milestones(rest)
        choices = []
        paths = list_spec_paths(self.store.root, self.store.config())
        if not paths:
            return super().cmd_milestones(rest)     # says there is none, and how to write one
        for path in paths:
            choices.append(((path, None), "%s  (the first ready milestone)" % path))
            for milestone in parse_spec(read_text(os.path.join(self.store.root, path))):
                choices.append(((path, milestone.id), "   [%s] %s (%s)" % (
                    "x" if milestone.completed else " ", milestone.display(), milestone.id)))
        if not choices:
            self.write("No specs yet; /spec drafts one.")
            return
        index = self.select("Select a spec or milestone", [label for _, label in choices])
        if index is not None:
            self.write(op_select_milestone(self.store, HUMAN, *choices[index][0]).text)

    def page(self, title, text):
        """A pager over the transcript area: ↑↓ PgUp PgDn Home End move, q or Esc closes."""
        curses = self.curses
        lines = [(_diff_line_kind(line) or "output", line)
                 for line in terminal_safe(text).expandtabs().split("\n")]
        saved_scroll, self.scroll = self.scroll, len(lines) * 8     # _tail clamps: the top

        def react(key):
            page = max(1, self.scr.getmaxyx()[0] - 4)
            moves = {curses.KEY_UP: 1, "k": 1, curses.KEY_DOWN: -1, "j": -1,
                     curses.KEY_PPAGE: page, "b": page, curses.KEY_NPAGE: -page, " ": -page,
                     curses.KEY_HOME: len(lines) * 8, "g": len(lines) * 8,
                     curses.KEY_END: -len(lines) * 8, "G": -len(lines) * 8}
            if key in moves:
                self.scroll = max(0, self.scroll + moves[key])
                return ...
            if key == "\x1b":
                if self.getkey(30) is None:
                    return None                  # a lone Esc closes
                while self.getkey(0) is not None:
                    pass                         # a key curses did not decode: ignored
                return ...
            return None if key in ("q", "Q", "\x03", "\r", "\n", curses.KEY_ENTER) else ...
        self.view = lines
        try:
            self._modal("%s — ↑↓ PgUp/PgDn Home/End (g/G) move · q closes" % title, react)
        finally:
            self.view, self.scroll = None, saved_scroll
        self.write("(%s: %d lines shown in the pager)" % (title, len(lines)))

    def attach_agent(self, rest):
        """The agent's live log in the transcript area until a key is pressed."""
        controller = self.focus_controller()
        slot = controller.slots.get(rest)
        if slot is None or slot.process is None:
            raise UsageError("no running agent called %r (running: %s)" % (rest, ", ".join(
                s.name for s in controller.running()) or "none"))
        process, lines, pending = slot.process, collections.deque(maxlen=5000), ""
        self.view, self.banner = lines, "attached to the %s — %s — any key returns" % (
            rest, self.store.relpath(process.log_path))
        try:
            with open(process.log_path, encoding="utf-8", errors="replace") as handle:
                while process is not None and self.getkey(100) is None and not self.done:
                    exited = slot.process is not process     # then read its last words
                    pending += handle.read()
                    *complete, pending = pending.split("\n")
                    lines.extend(complete)
                    if exited:
                        lines.extend(([pending] if pending else []) + ["[the agent exited]"])
                        process = None
                    self.poll()
                    self.draw()
            if process is None:
                self._modal(self.banner, lambda key: True)   # still until a key
        finally:
            self.view = self.banner = None
        self.write("--- detached from the %s ---" % rest)

    def interactive(self, role, prompt):
        """Leave curses while the agent CLI owns the terminal; HqShell keeps polling and
        holds the messages; curses comes back afterwards."""
        curses = self.curses
        curses.def_prog_mode()
        curses.endwin()
        print("--- the %s agent has the terminal; HQ continues when it exits ---" % role,
              flush=True)
        try:
            super().interactive(role, prompt)      # which leaves Ctrl+C to the agent
        finally:
            curses.reset_prog_mode()
            self.scr.clearok(True)
            self.status_due = 0


def hq_front_end(store, resume, no_tui):
    """CursesHq in a capable terminal, else the plain-line HqShell."""
    term = os.environ.get("TERM", "dumb")
    if not no_tui and term != "dumb" and sys.stdin.isatty() and sys.stdout.isatty():
        try:
            import curses
        except ImportError:              # Windows Python has no curses
            curses = None
        if curses is not None:
            with contextlib.suppress(curses.error):     # no terminfo entry for TERM
                curses.setupterm(term, sys.stdout.fileno())
                return CursesHq(store, resume=resume)
    return HqShell(store, resume=resume)
