#!/usr/bin/env python3
"""The web board's first paint in a real headless Chromium (figure web_first_paint).

    python bench/web.py [--quick] [--json] [--ferrus PATH] [--screenshots DIR]

Two pages, each loaded afresh several times in one Chromium (driven over the DevTools
protocol by tests/cdp.py) with the board served in this process:

- the board of a project with 200 tasks: from the navigation's start to the page's
  `ferrus:board` mark, set in the first animation frame after the 200 cards are in the
  DOM — the HTML, its script, GET /api/tasks and the rendering all count;
- a task whose diff has 5,000 lines (10 new files of 500 lines, in a git repository):
  to the `ferrus:diff` mark, after GET /api/tasks/ID and GET /api/tasks/ID/diff and every
  line's DOM, in the first frame after.

The median of 7 loads each (3 with --quick); info rows give the two API calls' own
time, read over HTTP in this process.  Without Chromium (or git, for the diff) the row
says so (n.a.).  bench/run.py takes the figure as `fig_web_first_paint(bench, fig)`; run
alone, this prints bench/run.py's table with that one figure.  `--screenshots DIR`
writes the pictures of docs/ instead: a demo project's board (web-board.png, and
web-board-phone.png at a phone's width) and one task's page (web-task.png).
"""

import argparse
import http.client
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TESTS = os.path.join(REPO, "tests")
DEFAULT_FERRUS = os.path.join(REPO, "ferrus.py")
BOARD_TASKS = 200
DIFF_FILES, DIFF_FILE_LINES = 10, 500
BOARD_BAR_S, DIFF_BAR_S = 0.300, 1.0


def load_ferrus(path):
    """The ferrus.py at ``path`` as the module ``ferrus`` (bench/run.py's already is)."""
    module = sys.modules.get("ferrus")
    if module is not None and os.path.abspath(getattr(module, "__file__", "")) == \
            os.path.abspath(path):
        return module
    spec = importlib.util.spec_from_file_location("ferrus", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["ferrus"] = module
    spec.loader.exec_module(module)
    return module


def chromium_driver():
    if TESTS not in sys.path:
        sys.path.insert(0, TESTS)
    import cdp
    return cdp


def git(root, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_AUTHOR_NAME="bench", GIT_AUTHOR_EMAIL="bench@example.com",
               GIT_COMMITTER_NAME="bench", GIT_COMMITTER_EMAIL="bench@example.com",
               GIT_CONFIG_NOSYSTEM="1")
    return subprocess.run(["git", "-c", "init.defaultBranch=main"] + list(args), cwd=root,
                          env=env, check=True, capture_output=True, text=True).stdout


# ============================================================================
# The projects measured
# ============================================================================

def board_project(ferrus, root):
    """A project with BOARD_TASKS tasks: most queued, some cancelled (two columns)."""
    os.makedirs(root)
    ferrus.init_project(root, report=lambda message: None)
    store = ferrus.Store(root)
    for number in range(BOARD_TASKS):
        task = ferrus.op_enqueue_task(store, ferrus.HUMAN, "Task %d: make part %d faster\n\n"
                                      "With a body." % (number, number)).data["task_id"]
        if number % 10 == 9:
            ferrus.op_cancel_task(store, ferrus.HUMAN, task)
    return store


def diff_project(ferrus, root):
    """The checkout's own task in a git repository, its diff 5,000 added lines."""
    os.makedirs(root)
    ferrus.init_project(root, report=lambda message: None)
    with open(os.path.join(root, "README.md"), "w") as handle:
        handle.write("bench\n")
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "start")
    store = ferrus.Store(root)
    ferrus.op_create_task(store, ferrus.HUMAN, "A big change")
    for number in range(DIFF_FILES):
        with open(os.path.join(root, "module_%02d.py" % number), "w") as handle:
            handle.write("".join("value_%04d = compute(%d, 'text of line %d')  # why\n"
                                 % (line, line, line) for line in range(DIFF_FILE_LINES)))
    return store, store.read_state().task_id


# ============================================================================
# Measuring
# ============================================================================

def api_seconds(board, path, reps):
    """The median time of GET ``path`` over HTTP, from the request to the last byte."""
    times = []
    for _ in range(reps):
        connection = http.client.HTTPConnection("127.0.0.1", board.port, timeout=60)
        started = time.perf_counter()
        connection.request("GET", path, headers={"Authorization": "Bearer " + board.token})
        answer = connection.getresponse()
        answer.read()
        times.append(time.perf_counter() - started)
        connection.close()
        if answer.status != 200:
            raise RuntimeError("GET %s answered %d" % (path, answer.status))
    return statistics.median(times)


def paint_seconds(page, url, mark, reps, ready):
    """The median time from navigation to the page's performance mark ``mark``."""
    times = []
    for _ in range(reps):
        page.navigate(url)
        page.wait_for(ready, timeout=60)
        page.wait_for("performance.getEntriesByName(%r).length > 0" % mark, timeout=60)
        times.append(page.evaluate("performance.getEntriesByName(%r)[0].startTime" % mark)
                     / 1000.0)
    return statistics.median(times)


def ms_text(seconds):
    return "%.0f ms" % (seconds * 1000) if seconds < 10 else "%.1f s" % seconds


def fig_web_first_paint(bench, fig):
    """First paint of the board with 200 tasks, and of a task's 5,000-line diff."""
    ferrus = bench.ferrus
    cdp = chromium_driver()
    if cdp.find_chromium() is None:
        fig.na("no Chromium (Debian: apt-get install chromium)", "≤ 300 ms / ≤ 1 s")
        return
    reps = 3 if bench.quick else 7
    store = board_project(ferrus, os.path.join(bench.tmp, "web-board"))
    diff = None
    if shutil.which("git"):
        diff = diff_project(ferrus, os.path.join(bench.tmp, "web-diff"))
    boards = [ferrus.WebBoard(store, "127.0.0.1", 0).start()]
    try:
        with cdp.Chromium() as browser:
            page = browser.page()
            board = boards[0]
            page.navigate(board.url)               # the cookie, once
            board_s = paint_seconds(page, board.base_url + "/", "ferrus:board", reps,
                                    "document.querySelectorAll('.card').length >= %d"
                                    % BOARD_TASKS)
            api_s = api_seconds(board, "/api/tasks", reps)
            fig.values.update(board_paint_s=board_s, board_api_s=api_s)
            fig.check("board, %d tasks: first paint %s (median of %d)" % (
                BOARD_TASKS, ms_text(board_s), reps), "≤ 300 ms", board_s <= BOARD_BAR_S)
            fig.info("(info) GET /api/tasks alone: %s" % ms_text(api_s))
            if diff is None:
                fig.na("git is not installed: no diff to show", "≤ 1 s")
                return
            diff_store, task = diff
            boards.append(ferrus.WebBoard(diff_store, "127.0.0.1", 0).start())
            board = boards[1]
            page.navigate(board.url)
            diff_s = paint_seconds(page, "%s/task/%s" % (board.base_url, task), "ferrus:diff",
                                   reps, "document.querySelectorAll('pre.diff span')"
                                   ".length >= %d" % (DIFF_FILES * DIFF_FILE_LINES))
            api_diff_s = api_seconds(board, "/api/tasks/%s/diff" % task, reps)
            fig.values.update(diff_paint_s=diff_s, diff_api_s=api_diff_s)
            fig.check("diff, %s lines in %d files: first paint %s (median of %d)" % (
                format(DIFF_FILES * DIFF_FILE_LINES, ","), DIFF_FILES, ms_text(diff_s), reps),
                "≤ 1 s", diff_s <= DIFF_BAR_S)
            fig.info("(info) GET /api/tasks/ID/diff alone: %s" % ms_text(api_diff_s))
    finally:
        for board in boards:
            board.close()


# ============================================================================
# Screenshots for docs/
# ============================================================================

def demo_project(ferrus, root):
    """A project whose board has a card in every column, usage, a question and a diff."""
    os.makedirs(root)
    ferrus.init_project(root, report=lambda message: None)
    with open(os.path.join(root, "ferrus.toml"), "a") as handle:
        handle.write('\n[hq]\nhuman_review = true\n')
    with open(os.path.join(root, "README.md"), "w") as handle:
        handle.write("# shop\n")
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "start")
    store = ferrus.Store(root)
    executor = ferrus.Caller("executor", "executor:claude-code:0")
    reviewer = ferrus.Caller("supervisor", "supervisor:claude-code:0")
    base = git(root, "rev-parse", "HEAD").strip()

    def started(text, agent="claude-code"):
        task = ferrus.op_enqueue_task(store, ferrus.HUMAN, text, agent=agent).data["task_id"]
        path = os.path.join(ferrus.default_worktree_dir(root), task)
        branch = ferrus.TASK_BRANCH_PREFIX + task
        ferrus.update_task(store, ferrus.HUMAN, task, "prepare_task", {
            "status": "running", "worktree": path, "branch": branch, "base": base,
            "target": "main", "store": "worktree",
            "started_at": ferrus.format_timestamp(ferrus.utc_now())})
        ferrus.create_task_worktree(root, path, branch, base)
        task_store = store.for_task(task)
        ferrus.atomic_write(task_store.task_path(ferrus.STATE_FILE), ferrus.StateData().to_json())
        ferrus.op_create_task(task_store, ferrus.HUMAN, text, task_id=task)
        return task, task_store, path

    def session(task, slot, tokens, cost, tools=()):
        name = "%s_%s.log" % (slot, task)
        lines = [json.dumps({"type": "assistant", "message": {"content": [
            {"type": "tool_use", "id": "t%d" % n, "name": tool, "input": arguments}]}})
            for n, (tool, arguments) in enumerate(tools)]
        with open(store.path("logs", name), "w") as handle:
            handle.write("\n".join(lines) + "\n")
        record = ferrus.open_session_record(
            store, "%s.s-%s" % (task, slot), slot=slot, role="executor" if slot == "executor"
            else "supervisor", agent="claude-code", model="claude-sonnet-4-5", task_id=task,
            log="%s/logs/%s" % (ferrus.FERRUS_DIR, name))
        record.update(input_tokens=tokens, output_tokens=tokens // 10, cost_usd=cost,
                      tool_calls=len(tools))
        ferrus.close_session_record(store, record, "success", exit_code=0)

    for text in ("Add a dark mode toggle to the settings page",
                 "Cache product images on the CDN",
                 "Translate the checkout into German"):
        ferrus.op_enqueue_task(store, ferrus.HUMAN, text)
    task, _, path = started("Paginate the order history API")
    with open(os.path.join(path, "orders.py"), "w") as handle:
        handle.write("def page(orders, size=50):\n    return orders[:size]\n")
    session(task, "executor", 48200, 0.182, [
        ("Read", {"file_path": "orders.py"}), ("Edit", {"file_path": "orders.py"}),
        ("Bash", {"command": "pytest -q tests/test_orders.py"})])
    task, task_store, path = started("Fix the rounding of VAT on invoices", agent="codex")
    with open(os.path.join(path, "invoice.py"), "w") as handle:
        handle.write("from decimal import Decimal, ROUND_HALF_UP\n\n\ndef vat(amount):\n"
                     "    return (Decimal(amount) * Decimal('0.19')).quantize(\n"
                     "        Decimal('0.01'), rounding=ROUND_HALF_UP)\n")
    ferrus.op_submit(task_store, executor, "Rounded half up, as the tax office wants.")
    session(task, "executor", 91000, None)
    asked, asked_store, path = started("Add a coupon field to the cart")
    with open(os.path.join(path, "cart.py"), "w") as handle:
        handle.write("class Cart:\n    def __init__(self):\n        self.items = []\n"
                     "        self.coupon = None\n\n    def apply(self, code):\n"
                     "        self.coupon = code.strip().upper()\n")
    session(asked, "executor", 63500, 0.241, [
        ("Read", {"file_path": "cart.py"}), ("Grep", {"pattern": "coupon", "path": "."}),
        ("Edit", {"file_path": "cart.py"}), ("Bash", {"command": "pytest -q"}),
        ("mcp__ferrus-executor__ask_human", {"question": "Percent or fixed amount?"})])
    ferrus.op_ask_human(asked_store, executor, "Should a coupon take a percentage off, or a "
                                               "fixed amount? The spec says both.")
    task, task_store, path = started("Send a receipt e-mail after payment")
    with open(os.path.join(path, "receipt.py"), "w") as handle:
        handle.write("def receipt(order):\n    return 'Thanks for order %s' % order.id\n")
    ferrus.op_submit(task_store, executor, "Receipt text and a test.")
    ferrus.op_approve(task_store, reviewer, "Covers the happy path and the refund case.")
    session(task, "executor", 30500, 0.094)
    session(task, "reviewer", 12800, 0.041)
    task, task_store, _ = started("Log slow database queries")
    ferrus.op_submit(task_store, executor, "Queries over 200 ms are logged.")
    ferrus.op_approve(task_store, reviewer, "Fine.")
    ferrus.op_human_approve(task_store, ferrus.HUMAN)
    for text, status in (("Upgrade the payment SDK", "merged"),
                         ("Remove the legacy coupon table", "merged"),
                         ("Rewrite the search in Rust", "cancelled"),
                         ("Flaky: shipping estimate test", "failed")):
        task = ferrus.op_enqueue_task(store, ferrus.HUMAN, text).data["task_id"]
        changes = {"status": status, "ended_at": ferrus.format_timestamp(ferrus.utc_now())}
        if status == "merged":
            changes.update(merged_commit=base, target="main")
        if status == "failed":
            changes["reason"] = "checks failed 3 times: pytest -q tests/test_shipping.py"
        ferrus.update_task(store, ferrus.HUMAN, task, "task_" + status, changes)
        if status == "merged":
            session(task, "executor", 54000, 0.173)
    return store, asked


def screenshots(ferrus, folder, tmp):
    cdp = chromium_driver()
    if cdp.find_chromium() is None:
        raise SystemExit("bench/web.py: --screenshots needs Chromium (apt-get install chromium)")
    store, asked = demo_project(ferrus, os.path.join(tmp, "shop"))
    board = ferrus.WebBoard(store, "127.0.0.1", 0).start()
    os.makedirs(folder, exist_ok=True)
    try:
        with cdp.Chromium(width=1440, height=760) as browser:
            page = browser.page()
            page.navigate(board.url)
            page.wait_for("document.querySelectorAll('.card').length >= 12")
            time.sleep(0.3)
            page.screenshot(os.path.join(folder, "web-board.png"))
            page.navigate("%s/task/%s" % (board.base_url, asked))
            page.wait_for("document.querySelector('pre.diff') !== null && "
                          "document.querySelector('textarea.answer') !== null")
            page.evaluate("document.querySelector('textarea.answer').value = 'A percentage; "
                          "at most 50%.'")
            page.send("Emulation.setDeviceMetricsOverride", {
                "width": 1100, "height": 1500, "deviceScaleFactor": 1, "mobile": False})
            time.sleep(0.3)
            page.screenshot(os.path.join(folder, "web-task.png"))
            page.send("Emulation.setDeviceMetricsOverride", {
                "width": 390, "height": 844, "deviceScaleFactor": 2, "mobile": True})
            page.navigate(board.base_url + "/")
            page.wait_for("document.querySelectorAll('.card').length >= 12")
            time.sleep(0.3)
            page.screenshot(os.path.join(folder, "web-board-phone.png"))
    finally:
        board.close()


# ============================================================================
# Alone: bench/run.py's table with this one figure
# ============================================================================

class LoneBench:
    """What fig_web_first_paint needs of bench/run.py's Bench."""

    def __init__(self, ferrus, ferrus_path, quick):
        self.ferrus, self.ferrus_path, self.quick = ferrus, ferrus_path, quick
        self.tmp = tempfile.mkdtemp(prefix="ferrus-bench-web-")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="bench/web.py", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 loads each instead of 7")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--ferrus", metavar="PATH", default=DEFAULT_FERRUS,
                        help="the ferrus.py to measure (default: the repo's)")
    parser.add_argument("--screenshots", metavar="DIR",
                        help="write the board's pictures for docs/ to DIR instead")
    args = parser.parse_args(argv)
    ferrus = load_ferrus(os.path.abspath(args.ferrus))
    bench = LoneBench(ferrus, os.path.abspath(args.ferrus), args.quick)
    try:
        if args.screenshots:
            screenshots(ferrus, args.screenshots, bench.tmp)
            print("bench/web.py: web-board.png, web-board-phone.png and web-task.png are in %s"
                  % args.screenshots)
            return 0
        sys.path.insert(0, HERE)
        import run as bench_run            # its Figure and table, as `make bench` prints them
        fig = bench_run.Figure("web_first_paint")
        started = time.perf_counter()
        try:
            fig_web_first_paint(bench, fig)
        except Exception as err:
            fig.fail("%s: %s" % (type(err).__name__, err))
        fig.seconds = time.perf_counter() - started
        head = bench_run.header(bench)
        if args.json:
            print(json.dumps({"header": head, "figures": [fig.to_json()]}, indent=2))
        else:
            print(bench_run.render_table(head, [fig]))
        return 0
    finally:
        shutil.rmtree(bench.tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
