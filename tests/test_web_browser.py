"""The web board in a real headless Chromium (Debian's `chromium`, driven over the DevTools
protocol by tests/cdp.py): it loads the board, follows `ferrus run --parallel 2` live —
each task's card moves from Queued to Merged without the page ever reloading — and the
human answers an agent's question and approves both tasks from the page.  Agent text
(a hostile title) is shown as text, never run.  Skipped, with the reason, where Chromium
or git is missing."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

import ferrus
from conftest import SCRIPTED_AGENT, custom_agent_config, set_config
from cdp import Chromium, find_chromium
from test_web_cli import Served, command, environment


pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(find_chromium() is None, reason="no Chromium installed (Debian: "
                       "apt-get install chromium; or set FERRUS_CHROMIUM)"),
    pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed"),
]

QUESTION = "Which colour should the button be?"
HOSTILE = "Hostile <img src=x onerror=\"document.title='pwned'\"><script>window.pwned=1</script>"


def git(root, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_CONFIG_NOSYSTEM="1")
    return subprocess.run(["git", "-c", "init.defaultBranch=main"] + list(args), cwd=str(root),
                          env=env, capture_output=True, text=True, check=True).stdout


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A git repository with the scripted agent in both roles, [hq] human_review on, and
    the executor that comes first asking the human a question."""
    root = tmp_path / "project"
    root.mkdir()
    for name in ("AUTHOR", "COMMITTER"):
        monkeypatch.setenv("GIT_%s_NAME" % name, "t")
        monkeypatch.setenv("GIT_%s_EMAIL" % name, "t@example.com")
    memory = tmp_path / "memory"
    memory.mkdir()
    monkeypatch.setenv("SCRIPTED_DIR", str(memory))
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "ask")
    git(root, "init", "-q")
    ferrus.init_project(str(root), report=lambda m: None)
    set_config(root, '[checks]\ncommands = ["test -f README.md"]\n\n[limits]\n'
               'wait_timeout_secs = 5\n\n[hq]\nhuman_review = true\n' +
               custom_agent_config("scripted", [sys.executable, SCRIPTED_AGENT, "{role}",
                                                "{mcp_config}"]))
    ferrus.register_agents(str(root), {"supervisor": ("scripted", None),
                                       "executor": ("scripted", None)}, report=lambda m: None)
    (root / "README.md").write_text("hello\n")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "start")
    return root


def columns(page):
    """{task id: the column its card is in} as the page shows it now."""
    return page.evaluate("""Object.fromEntries(Array.from(document.querySelectorAll(
        '.column .card')).map(c => [c.dataset.task, c.closest('.column').dataset.column]))""")


def click_card_with_badge(page, badge):
    page.evaluate("""(() => { const card = Array.from(document.querySelectorAll(
        '.column.awaiting .card')).find(c => Array.from(c.querySelectorAll('.badge.you'))
        .some(b => b.textContent === %r)); card.click(); return card.dataset.task; })()"""
                  % badge)


def go_home(page):
    page.evaluate("document.getElementById('home').click()")
    page.wait_for("document.querySelector('.columns .column') !== null")


def test_the_board_follows_a_parallel_run_and_the_human_answers_and_approves_from_it(repo):
    store = ferrus.Store(str(repo))
    tasks = [ferrus.op_enqueue_task(store, ferrus.HUMAN, text).data["task_id"] for text in (
        "Add alpha.\n\nWRITE alpha.txt: alpha", "Add beta.\n\nWRITE beta.txt: beta")]
    served = Served(repo, "--port", "0")
    run = None
    try:
        url = served.url()
        with Chromium() as browser:
            page = browser.page()
            page.navigate(url)
            assert page.evaluate("location.href") == url.split("?token=")[0]   # token gone
            page.wait_for("document.querySelectorAll('.column.queued .card').length === 2")
            page.evaluate("window.sameDocument = 'yes'")       # a reload would lose it
            seen = {task: set() for task in tasks}

            def watch():
                for task, column in columns(page).items():
                    if task in seen:
                        seen[task].add(column)
            watch()
            run = subprocess.Popen(
                command("run", "--parallel", "2", "--timeout", "240"),
                cwd=str(repo), env=dict(environment(), SCRIPTED_DIR=os.environ["SCRIPTED_DIR"],
                                        SCRIPTED_BEHAVIOR="ask"),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

            def until(condition, timeout=180, run_may_end=False):
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    watch()
                    if page.evaluate(condition):
                        watch()         # what made it true, too (it may have just happened)
                        return
                    # The last merge ends the run, maybe before the page has shown it.
                    assert run_may_end or run.poll() is None, run.stdout.read().decode()
                    time.sleep(0.05)
                raise AssertionError("timed out waiting for %s; seen %r" % (condition, seen))

            # The question: its card comes to "Awaiting you"; the answer is given on its page.
            until("""Array.from(document.querySelectorAll('.column.awaiting .badge.you'))
                     .some(b => b.textContent === 'question')""")
            click_card_with_badge(page, "question")
            page.wait_for("document.querySelector('textarea.answer') !== null")
            assert page.evaluate("document.querySelector('.question').textContent") == QUESTION
            page.evaluate("""(() => { document.querySelector('textarea.answer').value = 'Blue';
                document.querySelector('section.you button.primary').click(); })()""")
            page.wait_for("document.querySelector('textarea.answer') === null", timeout=60)
            go_home(page)
            # Each task's approval, confirmed from its page (confirm() is answered OK).
            for _ in tasks:
                until("""Array.from(document.querySelectorAll('.column.awaiting .badge.you'))
                         .some(b => b.textContent === 'approve?')""")
                click_card_with_badge(page, "approve?")
                page.wait_for("document.querySelector('section.you .approval') !== null")
                page.evaluate("document.querySelector('section.you button.primary').click()")
                page.wait_for("document.querySelector('section.you .approval') === null",
                              timeout=60)
                go_home(page)
            until("document.querySelectorAll('.column.merged .card').length === 2",
                  timeout=60, run_may_end=True)
            assert page.evaluate("window.sameDocument") == "yes"
            assert sorted(page.dialogs) == sorted("Approve task %s?" % ferrus.short_task_id(t)
                                                  for t in tasks)
        output = run.communicate(timeout=120)[0].decode()
        assert run.returncode == 0, output
    finally:
        if run is not None and run.poll() is None:
            run.kill()
            run.wait(10)
        served.stop()
    for task in tasks:
        assert {"queued", "merged"} <= seen[task], seen       # moved while the page watched
    assert ferrus.read_task_record(store.dir, tasks[0])["status"] == "merged"
    human = [(e["event"], e["task_id"]) for e in store.read_journal()
             if e["actor"] == "human/web"]
    assert sorted(event for event, _ in human) == ["answer", "human_approve", "human_approve"]
    assert {task for event, task in human if event == "human_approve"} == set(tasks)
    assert git(repo, "show", "main:answer.txt") == "Blue"
    assert {"alpha.txt", "beta.txt", "answer.txt"} <= set(
        git(repo, "ls-tree", "--name-only", "main").split())


def test_hostile_agent_text_is_shown_as_text_in_the_browser(project):
    store = ferrus.Store(str(project))
    task = ferrus.op_enqueue_task(store, ferrus.HUMAN, HOSTILE + "\n\n" + HOSTILE).data[
        "task_id"]
    store.append_event("hq", "note", {"said": HOSTILE, HOSTILE: HOSTILE}, task_id=task)
    served = Served(project, "--port", "0")
    try:
        url = served.url()
        with Chromium() as browser:
            page = browser.page()
            page.navigate(url)
            page.wait_for("document.querySelector('.card .title') !== null")
            assert page.evaluate("document.querySelector('.card .title').textContent") == HOSTILE
            page.evaluate("document.querySelector('.card').click()")
            page.wait_for("document.querySelectorAll('ol.events li').length === 2")
            assert page.evaluate("document.querySelector('.task h1').textContent") == HOSTILE
            assert HOSTILE in page.evaluate("document.querySelector('ol.events').textContent")
            assert page.evaluate("document.querySelectorAll('main img, main script').length") == 0
            assert page.evaluate("window.pwned === undefined && document.title !== 'pwned'")
    finally:
        served.stop()


def test_a_tab_whose_board_stopped_says_disconnected_after_a_few_tries(project):
    served = Served(project, "--port", "0")
    try:
        with Chromium() as browser:
            page = browser.page()
            page.navigate(served.url())
            page.wait_for("document.getElementById('live').textContent === 'live'")
            served.stop(signal.SIGKILL)         # gone at once, as a crash leaves it
            page.wait_for("document.getElementById('live').textContent"
                          ".startsWith('reconnecting')", timeout=10)
            # Five reconnects 2 s apart, then it stops trying.
            page.wait_for("document.getElementById('live').textContent"
                          ".startsWith('disconnected (the board stopped')", timeout=40)
    finally:
        served.stop()
