"""Tasks at a place: a parallel task worked elsewhere, mirrored into this project.

A task the parallel runner sends to a place (see places.py and docs/PLACES.md) keeps its
record here and a task store here that *mirrors* its state there: the state machine that
moves is the place's (its agents call its own ``ferrus serve``), the merge gate is
always this one.  PlaceTask stands where an HqController stands for a task here: the
runner polls it, reads its store, answers its questions and hands its verdicts through
it.  What the place's journal says of the task comes back as entries of this journal
(detail ``place``), its STATE.json and scratch files as one local commit each, its
controller's messages as the run's lines; the submitted commit is fetched (``index-pack
--strict``) before the mirror says Integrating, so the merge gate only ever reads a
commit this repository holds.  A human's word given here (HQ's /answer, ``ferrus
approve --task``) lands on the mirror first and is sent on to the place.
"""

import contextlib
import json
import threading

from .basics import FerrusError, format_timestamp, log, terminal_safe
from .config import AgentChoice, CONFIG_FILE, PLACE_HERE
from .task_machine import S, StateData
from .gates import Signals, usage_added, usage_since
from .store import (CANCELLED_STATUS, FAILED_STATUS, MERGED_STATUS, QUEUED_STATUS,
                    RUNNING_STATUS, UNCHANGED_STATUS, read_task_record)
from .git import task_ref
from .bootstrap import copy_sources, pack_local_files
from .worktrees import target_head
from .operations import ORCHESTRATOR, confirmation_summary, short_task_id
from .base_checks import without_red_base_note
from .task_queue import update_task
from .mcp import tool_calls_for_task
from .places import Place, PlaceBroken, PlaceUnreachable, place_project_key
from .sessions import HqMessage
from .orchestrator import task_sessions_started


# A place that could not prepare or start a task is left alone for this long, doubling
# up to the maximum (its tasks wait in the queue, never failed for the place's fault).
PLACE_BACKOFF_FIRST_SECS = 30.0
PLACE_BACKOFF_MAX_SECS = 600.0
# A job that ended without finishing (its lease ran out, it was killed) is started again
# this many times in a row before the task fails.
PLACE_JOB_RESTARTS = 3
# The local journal events that carry a human's word to a mirrored task.
PLACE_RELAYED_EVENTS = {"answer": ("answer", "ANSWER.md"),
                        "human_approve": ("approve", None),
                        "human_reject": ("reject", "REVIEW.md")}
_MESSAGE_KINDS = ("transition", "info", "warning", "error", "question", "agent", "confirm")


class PlaceDown:
    """The places a run left alone for a while, and until when (by ``clock``)."""

    def __init__(self, clock):
        self.clock = clock
        self.until = {}            # name -> monotonic time it may be tried again
        self.delay = {}            # name -> the backoff its next failure gets

    def down(self, name):
        return self.until.get(name, 0) > self.clock()

    def failed(self, name):
        """The place failed a task's prepare or start: leave it alone; returns for how long."""
        delay = self.delay.get(name, PLACE_BACKOFF_FIRST_SECS)
        self.until[name] = self.clock() + delay
        self.delay[name] = min(delay * 2, PLACE_BACKOFF_MAX_SECS)
        return delay

    def worked(self, name):
        self.until.pop(name, None)
        self.delay.pop(name, None)


class PlaceTask:
    """One task at a place, as the parallel runner sees it (an HqController's face: store,
    poll, slots, questions, signals, shutdown).  ``emit`` shows its lines, ``note`` says
    the runner's own."""

    def __init__(self, store, task, place, emit, note, notifier, lease_secs):
        self.project_store = store
        self.store = store.for_task(task)
        self.task = task
        self.place = place
        self.project = place_project_key(store.root)
        self.emit = emit
        self.note = note
        self.notifier = notifier
        self.lease_secs = lease_secs
        record = read_task_record(store.dir, task)
        self.executor_agent = record.get("agent")
        self.base = record.get("base")
        self.slots = {}                # its agents run there, not here
        self.shown_question = None
        self.shown_confirmation = None
        self.failure = None            # why it cannot go on (its agents stopped there)
        self.follower = None
        self.pending = []              # entries waiting for the state they led to
        self.held = None               # a state item waiting for its submission's fetch
        self.restarts = 0
        self.place_rev = 0             # the place's rev of the newest state mirrored
        self.acted_rev = 0             # the place's rev after this run's last act there
        self.seen_rev = None           # the local rev whose human acts were looked at
        self.fetched = set()
        self.retry_at = None           # when to try starting its job again (place down)
        self.stop_job = True           # shutdown also stops its job there (not when it ends:
                                       # its removal there does that)
        self.clock = store.monotonic
        self.usage = (0, 0)            # tokens and turns its sessions there reported
        self.baseline = Signals()      # its usage when the budget last started

    # -- the job there ----------------------------------------------------------------------

    def start(self, started=False):
        """Start (or renew: idempotent) the task's job there — unless ``started`` (its
        prepare started it this very moment) — and follow it from where the mirror
        stands.  Raises FerrusError (the place cannot be reached or refused)."""
        if not started:
            self.place.call("start", project=self.project, task=self.task,
                            lease=self.lease_secs)
        self._follow()
        return self

    def _follow(self):
        after, messages_from = 0, 0
        with contextlib.suppress(FerrusError):
            extra = self.store.read_state().extra
            after = int(extra.get("place_seq") or 0)
            messages_from = int(extra.get("place_at") or 0)
        if self.follower is not None:
            self.follower.stop()
        self.follower = self.place.follow(self.project_store, self.task, after=after,
                                          messages_from=messages_from,
                                          lease=self.lease_secs)

    def act(self, action, text=None, **fields):
        """An act on the task there (answer, approve, reject, integrated,
        integration_failed, save); its answer.  The mirror then follows."""
        answer = self.place.call("act", input=(text or "").encode("utf-8") if text is not None
                                 else None, project=self.project, task=self.task,
                                 action=action, **fields)
        if isinstance(answer.get("rev"), int):
            self.acted_rev = max(self.acted_rev, answer["rev"])
        return answer

    # -- what the runner asks of a controller ------------------------------------------------

    def poll(self):
        if self.follower is None:
            if self.retry_at is None or self.clock() < self.retry_at:
                return
            try:
                self.start()
                self.retry_at = None
            except FerrusError as err:
                self.retry_at = self.clock() + PLACE_BACKOFF_FIRST_SECS
                self.note("place %s still cannot be reached for task %s: %s" % (
                    self.place.name, self.task, err.message), "warning", task_id=self.task)
                return
        self._relay_local_acts()
        if self.held is not None:
            item, self.held = self.held, None
            self._take(item)
        while self.held is None:
            item = self.follower.get(timeout=0)
            if item is None:
                break
            self._take(item)

    def hold_session_moves(self):
        pass

    def release_session_moves(self):
        pass

    def running(self):
        return []

    def signals(self):
        """Its usage, counted as a task here counts it: tool calls and sessions from the
        journal and state mirrored here, tokens and turns as the place's last beat said
        (its session records stay there)."""
        try:
            data = self.store.read_state()
        except FerrusError:
            return Signals()
        tokens, turns = self.usage
        return usage_since(Signals(tool_calls=tool_calls_for_task(self.store, self.task),
                                   sessions=task_sessions_started(data),
                                   tokens_used=tokens, turns=turns), self.baseline)

    def agent_choice(self, role):
        config = self.store.config()
        choice = getattr(config, role)
        if role == "executor" and self.executor_agent and (
                choice is None or choice.agent != self.executor_agent):
            return AgentChoice(agent=self.executor_agent)
        return choice

    def continue_after_checkpoint(self):
        """The budget counts again from here (as HqController's)."""
        self.baseline = usage_added(self.baseline, self.signals())

    def stop_all(self, quiet=False):
        """An emergency stop: the job there ends (its agents get SIGTERM)."""
        with contextlib.suppress(FerrusError):
            self.place.call("stop", project=self.project, task=self.task)

    def shutdown(self):
        """This run stops following; the job there ends its agents (their work stays in its
        worktree there, for the next run to take up)."""
        if self.follower is not None:
            self.follower.stop()
            self.follower = None
        if self.stop_job:
            self.stop_all()

    # -- the mirror ----------------------------------------------------------------------------

    def _take(self, item):
        if "entry" in item and isinstance(item["entry"], dict):
            self.pending.append(item["entry"])
        elif "task" in item and isinstance(item["task"], dict):
            if not self._mirror(item["task"]):
                self.held = item
        elif "message" in item and isinstance(item["message"], dict):
            self._show(item["message"])
        elif "beat" in item:
            self._take_usage(item["beat"].get("usage"))
            self._flush(at=item["beat"].get("at"))
        elif "end" in item:
            self._flush()
            self._ended(item["end"])
        elif "lost" in item:
            self.note("task %s: lost touch with place %s (%s); following it again" % (
                self.task, self.place.name, item["lost"]), "warning", task_id=self.task)
            self._follow()

    def _take_usage(self, usage):
        """(tokens, turns) of the task's sessions there, as a beat reports them."""
        if isinstance(usage, dict) and all(
                type(usage.get(name)) is int and usage[name] >= 0 for name in ("tokens", "turns")):
            self.usage = (usage["tokens"], usage["turns"])

    def _show(self, message):
        kind = message.get("kind") if message.get("kind") in _MESSAGE_KINDS else "info"
        data = message.get("data") if isinstance(message.get("data"), dict) else {}
        self.emit(HqMessage(kind, str(message.get("text") or ""),
                            str(message.get("event") or ""), dict(data, place=self.place.name)))

    def _entry_detail(self, entry):
        detail = entry.get("detail") if isinstance(entry.get("detail"), dict) else {}
        return dict(detail, place=self.place.name, place_seq=entry.get("seq"))

    def _flush(self, at=None):
        """Entries that led to no new state (yet): journaled here as they were there."""
        for entry in self.pending:
            self._commit(None, None, entry, at)
        self.pending = []

    def _mirror(self, view):
        """The task's state and scratch files as the place has them, committed here with
        the entries that led to them; False when it must wait (its submission could not
        be fetched yet)."""
        try:
            state = StateData.from_json(json.dumps(view.get("state") or {}),
                                        "the STATE.json of task %s at place %s" % (
                                            self.task, self.place.name))
        except FerrusError as err:
            self.note("task %s: place %s sent a state this ferrus cannot read (%s); it is "
                      "left as it was" % (self.task, self.place.name, err.message), "warning",
                      task_id=self.task)
            return True
        if state.rev < max(self.acted_rev, self.place_rev):
            return True                 # older than what this run told the place since
        if not self._fetch_submission(state):
            return False
        entries, self.pending = self.pending, []
        for entry in entries[:-1]:
            self._commit(None, None, entry, None)
        files = view.get("files") if isinstance(view.get("files"), dict) else {}
        self._commit(state, files, entries[-1] if entries else None, None)
        self.place_rev = state.rev
        self._watch(state)
        return True

    def _fetch_submission(self, state):
        submitted = state.task_submitted if isinstance(state.task_submitted, dict) else {}
        commit = submitted.get("commit")
        if not isinstance(commit, str) or commit in self.fetched:
            return True
        ref = task_ref(self.task, "submit-%d" % submitted["n"]) if isinstance(
            submitted.get("n"), int) else task_ref(self.task, "place-submit")
        try:
            haves = [self.base] if self.base else []
            self.place.fetch_commit(self.project_store.root, self.project, commit,
                                    haves=haves, ref=ref)
        except FerrusError as err:
            if state.state not in (S.INTEGRATING, S.COMPLETE):
                log.debug("fetching %s from place %s failed: %s", commit, self.place.name,
                          err.full_text())
                return True          # the merge gate needs it later; tried again then
            self.note("task %s: its submission %s could not be fetched from place %s: %s; "
                      "tried again" % (self.task, commit[:12], self.place.name,
                                       err.full_text()), "warning", task_id=self.task)
            return False
        self.fetched.add(commit)
        return True

    def _commit(self, state, files, entry, at):
        """One local commit of the mirror: ``state`` (None: the state stays) and ``files``,
        journaled as ``entry`` (None: as place_state)."""
        actor = str(entry.get("actor") or "place") if entry else "place:%s" % self.place.name
        event = str(entry.get("event") or "place_state") if entry else "place_state"
        detail = self._entry_detail(entry) if entry else {"place": self.place.name}
        with self.store.transaction(actor) as tx:
            new = state.copy() if state is not None else tx.state.copy()
            seq = entry.get("seq") if entry and isinstance(entry.get("seq"), int) else None
            new.extra["place_seq"] = max(seq or 0, int(tx.state.extra.get("place_seq") or 0))
            if at is not None or "place_at" in tx.state.extra:
                new.extra["place_at"] = int(at if at is not None
                                            else tx.state.extra.get("place_at") or 0)
            for name, text in (files or {}).items():
                if isinstance(name, str) and isinstance(text, str):
                    tx.write(name, text)
            tx.set(new, event, **detail)
            tx.journal_task_id = self.task
        self.seen_rev = tx.state.rev if tx.committed is None else tx.committed.seq

    def _watch(self, state):
        """A question or a confirmation the place's task now waits for, for the runner
        (it answers through act); a notification when it needs a human."""
        if state.state == S.AWAITING_HUMAN:
            question = self.store.read_file("QUESTION.md").strip()
            if question and question != self.shown_question:
                self.shown_question = question
                self.notifier.notify("awaiting_human", self.task, question)
        else:
            self.shown_question = None
        if state.state == S.AWAITING_CONFIRMATION:
            self.shown_confirmation = (self.task, state.state_entered_at)
        else:
            self.shown_confirmation = None

    def _ended(self, end):
        """The job there ended: Complete or Failed as the mirror says; else (a lease that
        ran out, a kill) it is started again, a few times; agents that stopped for good
        fail the task."""
        job = end.get("job") if isinstance(end.get("job"), dict) else {}
        view = end.get("task") if isinstance(end.get("task"), dict) else {}
        if view.get("state") in (str(S.COMPLETE), str(S.FAILED)):
            return
        if job.get("reason") == "ended" and job.get("exit") == 1:
            self.failure = "its agents at place %s stopped and cannot go on (the job's log " \
                           "there says why)" % self.place.name
            return
        if self.restarts >= PLACE_JOB_RESTARTS:
            self.failure = "its job at place %s ended %d times without finishing (%s)" % (
                self.place.name, self.restarts + 1, job.get("reason") or "no reason given")
            return
        self.restarts += 1
        self.note("task %s: its job at place %s ended (%s); started again" % (
            self.task, self.place.name, job.get("reason") or "?"), "warning",
            task_id=self.task)
        try:
            self.start()
        except FerrusError as err:
            self.failure = "its job at place %s could not be started again: %s" % (
                self.place.name, err.full_text())

    def _relay_local_acts(self):
        """A human's answer, approval or rejection given here (HQ, `ferrus approve --task`)
        went to the mirror: send it on to the place, which is where the task moves."""
        try:
            rev = self.store.read_state().rev
        except FerrusError:
            return
        if self.seen_rev is None or rev == self.seen_rev:
            self.seen_rev = rev
            return
        since, self.seen_rev = self.seen_rev, rev
        found = []
        for entry in self.project_store.journal_entries_backwards():
            if entry.get("seq", 0) <= since:
                break
            detail = entry.get("detail") or {}
            if entry.get("task_id") == self.task and entry.get("event") in \
                    PLACE_RELAYED_EVENTS and "place" not in detail:
                found.append(entry)
        for entry in reversed(found):
            action, source = PLACE_RELAYED_EVENTS[entry["event"]]
            text = self.store.read_file(source) if source else None
            try:
                self.act(action, text)
            except FerrusError as err:
                self.note("task %s: the %s given here could not reach place %s: %s" % (
                    self.task, entry["event"].replace("_", " "), self.place.name,
                    terminal_safe(err.full_text())), "error", task_id=self.task)


def places_elsewhere(config):
    """Whether [parallel] places names a place besides this machine (then `ferrus run`
    works the queue with the parallel runner, whatever `--parallel`)."""
    return any(name != PLACE_HERE for name in config.parallel.places)


def place_for(places, config):
    """The Place channel of ``config`` (a PlaceConfig), one per place for the whole run:
    it caches which commits the place has, and ssh shares one connection per host."""
    place = places.get(config.name)
    if place is None:
        place = places[config.name] = Place(config)
    return place


def fetch_saved_work(place, root, project, task, base):
    """A cancelled task's work there, saved there as a commit (None when its worktree
    held nothing new) and fetched here under the same ref: {"ref", "commit"} or None."""
    saved = place.call("act", project=project, task=task, action="save").get("saved")
    if not isinstance(saved, dict) or not isinstance(saved.get("commit"), str):
        return None
    place.fetch_commit(root, project, saved["commit"], haves=[base] if base else [],
                       ref=saved.get("ref"))
    return {"ref": saved.get("ref"), "commit": saved["commit"]}


def send_onto(place, root, project, commit, task):
    """``commit`` (a target head, a merge gate's candidate) sent to the place before a
    task there is sent back onto it."""
    place.send_commit(root, project, commit, "%s-onto" % task)


# -- the parallel runner's side: tasks sent to places ---------------------------------------

class PlaceRunning:
    """What ParallelRunner does for places (mixed in before MergeQueue): a free slot is
    taken in [parallel] places order, a task at a place is prepared, followed, answered,
    sent back and removed there; a place that fails is left alone for a backoff while
    its tasks wait in the queue."""

    def _init_places(self, config, max_tasks_given):
        self.place_configs = config.places
        self.place_order = list(config.parallel.places)
        here = config.places[PLACE_HERE]
        # `--parallel N` is this machine's share; without it, [places.here] slots, else
        # [parallel] max_tasks.
        here_slots = self.max_tasks if max_tasks_given or here.slots is None else here.slots
        self.place_slots = {name: here_slots if name == PLACE_HERE else
                            config.places[name].slots for name in self.place_order}
        self.max_tasks = sum(self.place_slots.values()) or self.max_tasks
        self.place_channels = {}       # name -> Place, one channel per place for the run
        self.places_down = PlaceDown(self.clock)
        self.task_place = {}           # task in flight (or being prepared) -> its place
        self.sandboxes = {}            # task here -> its AgentSandbox ([sandbox] on)
        self._placing = threading.Lock()
        self._place_moves = {}         # task -> the commit its worktree there moves to
        self._started_there = set()    # tasks whose prepare there started their job
        self._removals = []            # threads removing merged tasks there
        self._first_prepare = {}       # place -> Lock held by its first prepare of the run
        self._prepared_at = set()      # places where a prepare of this run went through

    def _unplace(self, task):
        """A task chosen for a place but not prepared (nor running): its slot is free."""
        if task not in self.controllers:
            self.task_place.pop(task, None)

    def _place_used(self, name):
        return sum(1 for place in self.task_place.values() if place == name)

    def place_free_slots(self):
        """Free slots over every place of [parallel] places not left alone just now."""
        return sum(max(0, slots - self._place_used(name))
                   for name, slots in self.place_slots.items()
                   if not self.places_down.down(name))

    def _choose_place(self, task):
        """The first place in [parallel] places order with a free slot (None: none is)."""
        with self._placing:
            if task in self.task_place:
                return self.task_place[task]
            for name in self.place_order:
                if not self.places_down.down(name) and \
                        self._place_used(name) < self.place_slots[name]:
                    self.task_place[task] = name
                    return name
        return None

    def _channel(self, name):
        return place_for(self.place_channels, self.place_configs[name])

    def _place_lease(self):
        return max(60, self.store.config().lease.ttl_secs * 2)

    def _files_for_place(self, task, name):
        """([parallel] copy's paths, their packed files) for a task at place ``name``:
        none unless copy_to_places is on.  Listed in the task's record here as for a
        task here (linked files travel as copies: the checkout is not there)."""
        if not (self.parallel.copy and self.parallel.copy_to_places):
            return [], []
        paths = copy_sources(self.store.root, self.parallel.copy, skip=[self.worktree_dir])
        files = pack_local_files(self.store.root, paths)
        update_task(self.store, ORCHESTRATOR, task, "task_files_copied", {"copied": paths},
                    count=len(paths), mode="copy", place=name)
        return paths, files

    def _prepare_at_place(self, task, record, name, fail):
        """The task's base sent to place ``name``, its worktree and store made there and
        the task created there (Executing), its job started; here its record says where.
        A place that cannot be reached or refuses puts the task back in the queue (never
        failed for the place's fault) and is left alone for a while."""
        start = record.get("base") or target_head(self.store.root, self.target)
        if update_task(self.store, ORCHESTRATOR, task, "prepare_task", {
                "status": RUNNING_STATUS, "place": name, "store": "place", "base": start,
                "target": self.target, "started_at": record.get("started_at") or
                format_timestamp(self.store.clock())},
                only_from=(QUEUED_STATUS, RUNNING_STATUS), place=name,
                base=start[:12]) is None:
            self.task_place.pop(task, None)
            return False
        task_store = self.store.for_task(task)
        origin = record.get("origin") or {}
        try:
            if record.get("place") and record.get("store") != "place" and \
                    record["place"] in self.place_configs:
                # Retried: what its earlier try left at its place goes (its work was
                # saved and fetched when it ended, and goes on from there: resume_from).
                self._channel(record["place"]).call(
                    "remove", project=place_project_key(self.store.root), task=task)
            with self._placing:
                first = self._first_prepare.setdefault(name, threading.Lock())
            # The first prepare at a place may make the project's clone and store there:
            # the others of the batch wait for it, then go side by side.
            copied, files = self._files_for_place(task, name)
            with first if name not in self._prepared_at else contextlib.nullcontext():
                self._channel(name).prepare_task(
                    self.store, task, start, without_red_base_note(task_store.read_file(
                        "TASK.md")) + self.base_note,
                    origin={key: origin.get(key) for key in ("spec", "milestone")},
                    agent=record.get("agent"), resume_from=record.get("resume_from"),
                    lease=self._place_lease(),      # its job starts in the same call
                    copied=copied, files=files)
                self._prepared_at.add(name)
        except (PlaceUnreachable, PlaceBroken) as err:
            self._place_failed(task, name, err)
            return False
        except FerrusError as err:
            self.task_place.pop(task, None)
            if not fail:
                raise
            self._end_task(task, FAILED_STATUS, "could not prepare it at place %s: %s" % (
                name, err.full_text()))
            return False
        self.places_down.worked(name)
        self._started_there.add(task)
        task_store.create_state(StateData())     # the mirror's start (see PlaceTask)
        if record.get("resume_from"):
            update_task(self.store, ORCHESTRATOR, task, "task_work_restored",
                        {"resume_from": None}, commit=record["resume_from"][:12])
        return True

    def _place_failed(self, task, name, err):
        """Place ``name`` failed ``task``'s prepare or start: the task is queued again and
        the place left alone for a backoff."""
        self.task_place.pop(task, None)
        secs = self.places_down.failed(name)
        update_task(self.store, ORCHESTRATOR, task, "requeue_task", {
            "status": QUEUED_STATUS, "place": None, "store": None},
            only_from=(RUNNING_STATUS,), reason="place %s: %s" % (name, err.message))
        self.note("place %s failed task %s: %s; the task waits in the queue and the place "
                  "is left alone for %ds (`ferrus places` checks it)" % (
                      name, short_task_id(task), err.full_text(), secs), "warning",
                  task_id=task, place=name)

    def _adopt_at_place(self, task, record):
        """The controller of a task running at a place: its job started (or renewed) there
        and followed from where the mirror stands."""
        name = record.get("place")
        if name not in self.place_configs:
            self._end_task(task, FAILED_STATUS, "it ran at place %s, which %s no longer "
                           "names: add [places.%s] back and `ferrus task retry %s`, or "
                           "`ferrus task cancel %s`" % (name, CONFIG_FILE, name,
                                                        short_task_id(task),
                                                        short_task_id(task)))
            return None
        proxy = PlaceTask(self.store, task, self._channel(name), self._task_emitter(task),
                          self.note, self.notifier, self._place_lease())
        try:
            proxy.start(started=task in self._started_there)
            self._started_there.discard(task)
        except (PlaceUnreachable, PlaceBroken) as err:
            secs = self.places_down.failed(name)
            self.note("place %s cannot be reached for task %s (%s): tried again in %ds" % (
                name, short_task_id(task), err.full_text(), secs), "warning", task_id=task)
            proxy.retry_at = self.clock() + secs
        self.task_place[task] = name
        self.controllers[task] = proxy
        return proxy

    def _watch_place_task(self, task, controller, data, record):
        """_watch_task for a task at a place: its failure there, its end, and the human's
        word on its questions, which go there."""
        if controller.failure:
            self._end_task(task, FAILED_STATUS, controller.failure)
            return
        if data.state == S.FAILED:
            self._end_task(task, FAILED_STATUS, data.failure_reason)
            return
        try:
            if data.state == S.AWAITING_HUMAN and controller.shown_question:
                answer = self.ask(controller.shown_question) if self.ask else None
                if answer is None:
                    self.waiting_human.add(task)
                elif answer.strip():
                    controller.act("answer", answer)
                else:
                    self._seen = None
            elif data.state == S.AWAITING_CONFIRMATION and controller.shown_confirmation:
                decision = self.review(confirmation_summary(controller.store, data)) \
                    if self.review else None
                if decision is None:
                    self.waiting_human.add(task)
                else:
                    verdict, notes = decision
                    if verdict == "approve":
                        controller.act("approve")
                    else:
                        controller.act("reject", notes or "")
            else:
                self.waiting_human.discard(task)
        except FerrusError as err:
            self.note("task %s: the answer could not reach place %s: %s" % (
                short_task_id(task), record.get("place"), err.full_text()), "error",
                task_id=task)

    def _end_at_place(self, task, record, status, controller):
        """A task at a place ended here: a cancelled or failed one's job is stopped and its
        work saved there and fetched (unless discarded); a merged, unchanged or cancelled
        one is removed there, a failed one's worktree there kept for a look (`ferrus
        places --clean` removes it).  Returns what to add to the end's line."""
        name = record.get("place")
        if name not in self.place_configs:
            return ""
        place = self._channel(name)
        project = place_project_key(self.store.root)
        said = ""
        try:
            if status in (CANCELLED_STATUS, FAILED_STATUS):
                # Its work is saved there and fetched here (a retry goes on from it).
                place.call("stop", project=project, task=task)
                if not record.get("discard"):
                    saved = fetch_saved_work(place, self.store.root, project, task,
                                             record.get("base"))
                    if saved:
                        update_task(self.store, ORCHESTRATOR, task, "task_work_saved",
                                    {"saved": saved}, commit=saved["commit"][:12],
                                    ref=saved["ref"])
                        said = " Its work at place %s is saved as %s (%s)." % (
                            name, saved["commit"][:12], saved["ref"])
            if status in (MERGED_STATUS, UNCHANGED_STATUS):
                # Nothing of it is needed there any more: removed beside the run, so the
                # next task's merge does not wait for the place.
                removal = threading.Thread(target=self._remove_there, args=(place, task, name),
                                           daemon=True, name="ferrus-remove-%s" % task)
                removal.start()
                self._removals.append(removal)
            elif status != FAILED_STATUS:
                self._remove_there(place, task, name)
        except FerrusError as err:
            self.note("task %s: place %s could not be tidied (%s); `ferrus places --clean` "
                      "removes what is left there" % (short_task_id(task), name,
                                                      err.full_text()), "warning",
                      task_id=task)
        return said

    def _remove_there(self, place, task, name):
        try:
            place.call("remove", project=place_project_key(self.store.root), task=task)
            update_task(self.store, ORCHESTRATOR, task, "place_tidied",
                        {"place_tidied": True}, place=name)
        except FerrusError as err:
            self.note("task %s: place %s could not remove it (%s); `ferrus places --clean` "
                      "removes what is left there" % (short_task_id(task), name,
                                                      err.full_text()), "warning",
                      task_id=task)

    def finish_place_removals(self, timeout=60):
        """Wait for the removals under way at places (the run is ending)."""
        for removal in self._removals:
            removal.join(timeout)
        self._removals = []

    def _tidy_places(self, records):
        """Tasks at a place cancelled while no run followed them (`ferrus task cancel`
        with no orchestrator): their work is saved there and fetched, and they are removed
        there, as a run does at a cancel; merged ones whose removal there a stopped run
        did not see through are removed now."""
        for task, record in records:
            if record.get("store") == "place" and record.get("status") in (
                    CANCELLED_STATUS, MERGED_STATUS, UNCHANGED_STATUS) and \
                    not record.get("place_tidied"):
                said = self._end_at_place(task, record, CANCELLED_STATUS, None)
                if said:
                    self.note("task %s was cancelled while no run followed it.%s" % (
                        short_task_id(task), said), "warning", task_id=task)

    # -- the merge queue's verdict, for a task at a place ------------------------------------

    def _move_worktree(self, task, checkout, submitted, commit):
        if isinstance(self.controllers.get(task), PlaceTask):
            self._place_moves[task] = commit     # the worktree there moves (see _send_back)
            return
        super()._move_worktree(task, checkout, submitted, commit)

    def _send_back(self, task, notes, onto=None, checks=None, **detail):
        controller = self.controllers.get(task)
        if isinstance(controller, PlaceTask):
            move_to = self._place_moves.pop(task, None)
            project = place_project_key(self.store.root)
            try:
                for commit in (onto, move_to):
                    if commit:
                        send_onto(controller.place, self.store.root, project, commit, task)
                fields = {"onto": onto} if onto else {}
                if move_to:
                    fields["move_to"] = move_to
                controller.act("integration_failed", notes, detail=json.loads(json.dumps(
                    detail, default=str)), **fields)
            except FerrusError as err:
                self._wait(task, "its verdict could not reach place %s: %s" % (
                    controller.place.name, err.full_text()))
                return
        super()._send_back(task, notes, onto, checks, **detail)
