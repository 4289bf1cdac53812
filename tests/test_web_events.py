"""The web board is live through Server-Sent Events from the journal (GET /api/events):
each entry an event whose id is its seq, resumable with Last-Event-ID, bookkeeping left
out unless asked, one task's entries with ?task=, a reset when a stream missed more than
can be replayed, keep-alive comments, and a `sessions` event when a session record is
written.  One feed thread per board watches the store; the streams wait on it."""

import time

import pytest

import ferrus
from web_client import BoardClient, running_board


@pytest.fixture
def board(store):
    with running_board(store) as running:
        yield running


@pytest.fixture
def client(board):
    return BoardClient(board)


def enqueue(store, text):
    return ferrus.op_enqueue_task(store, ferrus.HUMAN, text).data["task_id"]


def caught_up(board, store):
    """Until the board's feed has read the journal to its end."""
    deadline = time.monotonic() + 10
    while board.feed.latest < store.last_journal_seq() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert board.feed.latest == store.last_journal_seq()


def journal_blocks(blocks):
    return [(int(b["id"]), b["data"]["event"], b["data"].get("task_id"))
            for b in blocks if b["event"] == "journal"]


def test_a_stream_from_now_gets_what_happens_next_with_seqs_as_ids(client, store):
    enqueue(store, "Before the stream")
    stream = client.events()
    try:
        assert stream.status == 200
        assert stream.response.getheader("Content-Type") == "text/event-stream; charset=utf-8"
        assert stream.response.getheader("X-Content-Type-Options") == "nosniff"
        first = stream.next()
        assert first["comments"] == ["ferrus journal"]
        task = enqueue(store, "After it")
        seen = stream.until(lambda b: b["event"] == "journal")
        assert journal_blocks(seen) == [(store.last_journal_seq(), "enqueue_task", task)]
        assert seen[-1]["data"]["actor"] == "human"
        assert seen[-1]["data"]["detail"] == {"title": "After it"}
    finally:
        stream.close()


def test_last_event_id_resumes_after_that_seq(client, store):
    tasks = [enqueue(store, "Task %d" % n) for n in range(4)]
    stream = client.events(last_event_id=2)
    try:
        seen = stream.until(lambda b: b["id"] == "4")
        assert journal_blocks(seen) == [(3, "enqueue_task", tasks[2]),
                                        (4, "enqueue_task", tasks[3])]
    finally:
        stream.close()


def test_after_starts_a_stream_and_last_event_id_wins_over_it(client, store):
    for n in range(3):
        enqueue(store, "Task %d" % n)
    stream = client.events("?after=1")
    try:
        assert [seq for seq, _, _ in journal_blocks(stream.until(lambda b: b["id"] == "3"))] \
            == [2, 3]
    finally:
        stream.close()
    # A browser reconnecting keeps the URL it opened and sends Last-Event-ID.
    stream = client.events("?after=0", last_event_id=2)
    try:
        assert [seq for seq, _, _ in journal_blocks(stream.until(lambda b: b["id"] == "3"))] \
            == [3]
    finally:
        stream.close()


def test_one_tasks_stream_and_bookkeeping_left_out_unless_asked(client, store):
    mine, other = enqueue(store, "Mine"), enqueue(store, "Other")
    store.append_event("hq", "heartbeat", {}, task_id=mine)              # bookkeeping
    store.append_event("ferrus", "note", {"text": "about mine"}, task_id=mine)
    stream = client.events("?task=%s" % mine, last_event_id=0)
    try:
        seen = stream.until(lambda b: b["id"] == "4")
        assert journal_blocks(seen) == [(1, "enqueue_task", mine), (4, "note", mine)]
    finally:
        stream.close()
    stream = client.events("?all=1", last_event_id=0)
    try:
        events = [event for _, event, _ in journal_blocks(stream.until(lambda b: b["id"] == "4"))]
        assert events == ["enqueue_task", "enqueue_task", "heartbeat", "note"]
    finally:
        stream.close()
    assert other


def test_entries_a_stream_skips_still_move_its_last_event_id_on(client, store):
    task = enqueue(store, "Watched")
    stream = client.events("?task=%s" % task, last_event_id=1)
    try:
        stream.next()                                         # the opening comment
        enqueue(store, "Someone else's")                     # seq 2, not this stream's
        block = stream.next()
        # No event is dispatched, but the browser's Last-Event-ID becomes 2, so a
        # reconnect does not read it again.
        assert block == {"event": None, "id": "2", "data": None, "comments": []}
    finally:
        stream.close()


def test_a_stream_that_missed_too_much_is_told_to_reload(client, store, monkeypatch):
    monkeypatch.setattr(ferrus, "WEB_REPLAY_MAX", 3)
    for n in range(8):
        enqueue(store, "Task %d" % n)
    board = client.board
    caught_up(board, store)
    board.feed.kept.clear()                       # as if the board started long after
    stream = client.events(last_event_id=1)
    try:
        seen = stream.until(lambda b: b["event"] == "reset")
        assert seen[-1]["data"] == {"seq": 8} and seen[-1]["id"] == "8"
        assert journal_blocks(seen) == []
        task = enqueue(store, "After the reset")
        assert journal_blocks(stream.until(lambda b: b["event"] == "journal")) == [
            (9, "enqueue_task", task)]
    finally:
        stream.close()


def test_a_stream_from_beyond_the_journals_end_is_told_to_reload(client, store):
    enqueue(store, "Only one")
    stream = client.events(last_event_id=500)
    try:
        assert stream.next()["comments"] == ["ferrus journal"]
        block = stream.next()
        assert block["event"] == "reset" and block["data"] == {"seq": 1} and block["id"] == "1"
        task = enqueue(store, "Next")
        assert journal_blocks(stream.until(lambda b: b["event"] == "journal")) == [
            (2, "enqueue_task", task)]
    finally:
        stream.close()


def test_a_short_gap_is_replayed_from_the_journal_when_memory_does_not_reach(client, store):
    for n in range(5):
        enqueue(store, "Task %d" % n)
    caught_up(client.board, store)
    client.board.feed.kept.clear()
    stream = client.events(last_event_id=3)
    try:
        assert [seq for seq, _, _ in journal_blocks(stream.until(lambda b: b["id"] == "5"))] \
            == [4, 5]
    finally:
        stream.close()


def test_a_quiet_stream_gets_keep_alive_comments(store):
    with running_board(store, keepalive=0.05) as board:
        stream = BoardClient(board).events()
        try:
            stream.next()
            assert stream.next()["comments"] == ["keep-alive"]
        finally:
            stream.close()


def test_a_written_session_record_is_announced(client, store):
    stream = client.events()
    try:
        stream.next()
        ferrus.open_session_record(store, "s-web-1", slot="executor", role="executor",
                                   agent="claude-code")
        block = stream.until(lambda b: b["event"] == "sessions")[-1]
        assert block["id"] is None and block["data"]["generation"] >= 1
    finally:
        stream.close()


def test_the_stream_goes_on_across_a_journal_rotation(client, store):
    enqueue(store, "Before")
    stream = client.events(last_event_id=1)
    try:
        stream.next()
        ferrus.op_rotate_journal(store, ferrus.HUMAN)
        task = enqueue(store, "After the rotation")
        seen = journal_blocks(stream.until(lambda b: b["event"] == "journal" and
                                           b["data"]["event"] == "enqueue_task"))
        assert seen == [(2, "journal_rotated", None), (3, "enqueue_task", task)]
    finally:
        stream.close()


def test_closing_the_board_ends_its_streams(store):
    with running_board(store) as board:
        stream = BoardClient(board).events()
        stream.next()
        assert board.app.streams == 1
    with pytest.raises(EOFError):
        while True:
            stream.next()
    stream.close()


def test_the_feed_reads_only_what_the_journal_gained(store):
    enqueue(store, "Old")
    feed = ferrus.JournalFeed(store)
    assert feed.latest == 1 and feed.entries_after(1) == []
    generation = feed.generation
    task = enqueue(store, "New")
    feed.look()
    assert feed.generation == generation + 1 and feed.latest == 2
    assert [e["task_id"] for e in feed.entries_after(1)] == [task]
    assert [e["seq"] for e in feed.entries_after(0)] == [1, 2]     # the journal, read again
    feed.look()
    assert feed.generation == generation + 1                       # nothing new: no wake-up
