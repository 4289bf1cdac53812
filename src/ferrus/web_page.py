"""The web board's page: its HTML, CSS and JavaScript, inline, nothing fetched.

One page serves the board (/) and a task's page (/task/ID): the script reads the path,
fetches the JSON API (/api/tasks, /api/tasks/ID, its diff, /api/logs/NAME), renders it,
and listens to /api/events (Server-Sent Events from the journal) to fetch again when
something happened — it never polls.  It works in current Chromium and Firefox with no
library.  Every text it shows came from an agent, a check or a file, so the DOM is built
with createElement and textContent only (never innerHTML); the server sends the page with
a Content-Security-Policy that lets only this script and style run (their nonce).  The
script marks `ferrus:board` and `ferrus:diff` with performance.mark() once the board or a
diff is painted (bench/web.py reads them).
"""

import re

WEB_PAGE_STYLE = r"""
:root { color-scheme: light dark; --bg: #f6f7f9; --fg: #1d2330; --muted: #667085;
  --card: #ffffff; --line: #d9dde5; --accent: #2f6fed; --add: #e6ffec; --add-fg: #116329;
  --del: #ffebe9; --del-fg: #a40e26; --hunk: #ddf4ff; --warn: #9a6700; --bad: #c9302c;
  --good: #1a7f37; --you: #fff4d6; }
@media (prefers-color-scheme: dark) {
  :root { --bg: #101318; --fg: #e6e9ef; --muted: #98a2b3; --card: #1a1f27; --line: #2d3440;
    --accent: #6c9cff; --add: #12261a; --add-fg: #7ee2a0; --del: #2d1417; --del-fg: #ff9aa5;
    --hunk: #10263a; --warn: #e3b341; --bad: #ff7b72; --good: #56d364; --you: #2e2712; }
}
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif;
  background: var(--bg); color: var(--fg); }
header { display: flex; gap: 12px; align-items: baseline; padding: 10px 16px;
  border-bottom: 1px solid var(--line); background: var(--card); position: sticky; top: 0;
  z-index: 2; }
header a.home { font-weight: 700; color: var(--fg); text-decoration: none; font-size: 16px; }
#project { color: var(--muted); overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }
#live { margin-left: auto; font-size: 12px; color: var(--muted); white-space: nowrap; }
#live.on::before { content: "\25CF  "; color: var(--good); }
#live.off::before { content: "\25CF  "; color: var(--bad); }
main { padding: 12px 16px 40px; }
button { font: inherit; padding: 4px 12px; white-space: nowrap; border-radius: 6px;
  border: 1px solid var(--line); background: var(--card); color: var(--fg); cursor: pointer; }
button.primary { background: var(--accent); border-color: var(--accent); color: #fff; }
button.danger { color: var(--bad); }
button:disabled { opacity: .5; cursor: default; }
textarea { font: inherit; width: 100%; min-height: 4.5em; padding: 6px; border-radius: 6px;
  border: 1px solid var(--line); background: var(--card); color: var(--fg); }
.toolbar { display: flex; gap: 10px; align-items: flex-start; margin-bottom: 12px;
  flex-wrap: wrap; }
.toolbar form, .addtask { flex: 1 1 420px; display: flex; gap: 8px; align-items: flex-start; }
.addtask textarea { min-height: 2.4em; height: 2.4em; }
.muted { color: var(--muted); }
.columns { display: flex; gap: 10px; align-items: flex-start; overflow-x: auto;
  padding-bottom: 8px; }
.column { flex: 1 1 0; min-width: 168px; min-height: 80px; }
.column h2 { font-size: 12px; text-transform: uppercase; letter-spacing: .04em;
  color: var(--muted); margin: 0 0 8px; display: flex; justify-content: space-between; }
.column.awaiting h2 { color: var(--warn); }
.card { display: block; background: var(--card); border: 1px solid var(--line);
  border-radius: 8px; padding: 8px 10px; margin-bottom: 8px; color: var(--fg);
  text-decoration: none; overflow-wrap: anywhere; }
.card:hover { border-color: var(--accent); }
.column.awaiting .card { background: var(--you); }
.card .title { font-weight: 600; display: block; margin-bottom: 4px; }
.card .meta, .card .last { font-size: 12px; color: var(--muted); display: block; }
.card .last.failed { color: var(--bad); }
.badge { display: inline-block; font-size: 11px; padding: 0 6px; border-radius: 9px;
  border: 1px solid var(--line); margin-right: 4px; color: var(--muted); }
.badge.you { color: var(--warn); border-color: var(--warn); }
.badge.bad { color: var(--bad); border-color: var(--bad); }
.task h1 { font-size: 20px; margin: 4px 0; overflow-wrap: anywhere; }
.facts { color: var(--muted); display: flex; flex-wrap: wrap; gap: 4px 14px; font-size: 13px; }
section { background: var(--card); border: 1px solid var(--line); border-radius: 8px;
  padding: 10px 12px; margin: 12px 0; }
section h2 { font-size: 14px; margin: 0 0 8px; }
section.you { border-color: var(--warn); background: var(--you); }
.actions { display: flex; gap: 8px; flex-wrap: wrap; margin: 10px 0; }
pre, .text { white-space: pre-wrap; overflow-wrap: anywhere; margin: 0;
  font: 12.5px/1.4 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
.text { font: inherit; }
ol.events { list-style: none; padding: 0; margin: 0; }
ol.events li { padding: 4px 0; border-top: 1px solid var(--line); overflow-wrap: anywhere; }
ol.events li:first-child { border-top: 0; }
.events .when { color: var(--muted); font-size: 12px; margin-right: 8px; }
.events .what { font-weight: 600; margin-right: 6px; }
.events .who { color: var(--muted); font-size: 12px; margin-right: 6px; }
.events .moved { margin-right: 6px; }
.events .detail { color: var(--muted); font-size: 12px; }
.check { margin: 2px 0 0 16px; font-size: 12px; }
.check.failed, .failed { color: var(--bad); }
.check.passed { color: var(--good); }
.tail { margin: 2px 0 4px 16px; padding: 4px 6px; background: var(--bg); border-radius: 4px; }
.quote { margin: 4px 0 0 16px; padding-left: 8px; border-left: 3px solid var(--line); }
table { border-collapse: collapse; width: 100%; font-size: 12.5px; }
td, th { text-align: left; padding: 3px 6px; border-top: 1px solid var(--line);
  vertical-align: top; overflow-wrap: anywhere; }
.tools li { font: 12.5px/1.4 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace;
  overflow-wrap: anywhere; }
details.file { border: 1px solid var(--line); border-radius: 6px; margin: 6px 0; }
details.file > summary { padding: 4px 8px; cursor: pointer; font-family: ui-monospace,
  SFMono-Regular, Menlo, Consolas, monospace; font-size: 12.5px; overflow-wrap: anywhere; }
details.file > summary .plus { color: var(--add-fg); margin-left: 8px; }
details.file > summary .minus { color: var(--del-fg); margin-left: 4px; }
pre.diff { padding: 4px 0; overflow-x: auto; white-space: pre; }
pre.diff span { display: block; padding: 0 8px; }
pre.diff .add { background: var(--add); color: var(--add-fg); }
pre.diff .del { background: var(--del); color: var(--del-fg); }
pre.diff .hunk { background: var(--hunk); color: var(--muted); }
pre.diff .meta { color: var(--muted); }
pre.log { max-height: 480px; overflow: auto; background: var(--bg); padding: 6px;
  border-radius: 4px; margin-top: 6px; }
.logbar { display: flex; gap: 8px; align-items: center; margin-top: 6px; font-size: 12px; }
#toast { position: fixed; left: 50%; bottom: 16px; transform: translateX(-50%);
  max-width: min(720px, 92vw); background: var(--card); border: 1px solid var(--line);
  border-radius: 8px; padding: 8px 12px; box-shadow: 0 4px 16px rgba(0,0,0,.18);
  white-space: pre-wrap; overflow-wrap: anywhere; display: none; z-index: 5; }
#toast.show { display: block; }
#toast.error { border-color: var(--bad); }
#toast .hint { color: var(--muted); display: block; margin-top: 4px; }
@media (max-width: 720px) {
  .columns { flex-direction: column; }
  .column.awaiting { order: -1; }          /* on a phone, what waits for you comes first */
  .column { flex: 1 1 auto; width: 100%; }
  main { padding: 10px; }
}
"""

WEB_PAGE_SCRIPT = r"""
"use strict";
(function () {
  const main = document.getElementById("main");
  const live = document.getElementById("live");
  const projectName = document.getElementById("project");
  const toast = document.getElementById("toast");
  const RECONNECTS_TRIED = 5;   // failed reconnects before "disconnected" (about 10 s)
  let source = null;
  let view = null;              // {kind: "board"} or {kind: "task", id, ...}
  let showAll = false;
  let timer = null, busy = false, again = false, lastSessionsRefresh = 0;

  // -- small helpers: every text goes through textContent ------------------------------
  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }
  function add(parent) {
    for (let i = 1; i < arguments.length; i++) if (arguments[i]) parent.appendChild(arguments[i]);
    return parent;
  }
  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); return node; }
  function count(n) {
    n = Number(n) || 0;
    if (n >= 1e9) return (n / 1e9).toFixed(1).replace(/\.0$/, "") + "G";
    if (n >= 1e6) return (n / 1e6).toFixed(1).replace(/\.0$/, "") + "M";
    if (n >= 1e3) return (n / 1e3).toFixed(1).replace(/\.0$/, "") + "k";
    return String(Math.round(n));
  }
  function duration(secs) {
    if (secs === null || secs === undefined || isNaN(secs)) return "?";
    secs = Math.max(0, Math.round(secs));
    if (secs < 60) return secs + "s";
    if (secs < 3600) return Math.floor(secs / 60) + "m";
    const minutes = Math.floor(secs / 60) % 60;
    if (secs < 86400) return Math.floor(secs / 3600) + "h" + (minutes ? " " + minutes + "m" : "");
    return Math.floor(secs / 86400) + "d";
  }
  function cost(value) {
    if (value === null || value === undefined) return "";
    return "$" + (value < 1 ? Number(value).toFixed(4) : Number(value).toFixed(2));
  }
  function when(stamp) {
    const moment = new Date(stamp);
    return isNaN(moment) ? String(stamp || "") : moment.toLocaleString();
  }
  function short(id) {
    const text = String(id || ""), dash = text.lastIndexOf("-");
    return dash >= 0 ? text.slice(dash + 1) : text;
  }
  function taskPath(id) { return "/task/" + encodeURIComponent(id); }

  function say(text, error, hint) {
    clear(toast);
    toast.className = "show" + (error ? " error" : "");
    add(toast, el("span", "", text));
    if (hint) add(toast, el("span", "hint", "hint: " + hint));
    clearTimeout(say.timer);
    say.timer = setTimeout(function () { toast.className = ""; }, error ? 12000 : 5000);
  }

  async function api(path, body) {
    const init = {credentials: "same-origin", headers: {"Accept": "application/json"}};
    if (body !== undefined) {
      init.method = "POST";
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const response = await fetch(path, init);
    let data;
    try {
      data = await response.json();
    } catch (e) {
      data = {error: "the board answered HTTP " + response.status};
    }
    if (!response.ok) {
      const err = new Error(data.error || ("HTTP " + response.status));
      err.hint = data.hint; err.status = response.status; err.data = data;
      throw err;
    }
    return data;
  }
  function failed(err) { say(err.message, true, err.hint); }

  // -- live: the journal, pushed --------------------------------------------------------
  function listen(seq) {
    if (source) return;
    source = new EventSource("/api/events?after=" + encodeURIComponent(seq));
    // A stopped board refuses the browser's reconnects forever (one each 2 s, the
    // stream's retry): after RECONNECTS_TRIED in a row the page stops trying and says so.
    let failures = 0;
    source.onopen = function () { failures = 0; live.className = "on"; live.textContent = "live"; };
    source.onerror = function () {
      failures += 1;
      live.className = "off";
      if (source.readyState === EventSource.CLOSED || failures > RECONNECTS_TRIED) {
        source.close();
        live.textContent = "disconnected (the board stopped, or restarted with a new " +
          "token): reload when `ferrus web` runs again";
      } else {
        live.textContent = "reconnecting…";
      }
    };
    source.addEventListener("journal", function (message) {
      let entry;
      try { entry = JSON.parse(message.data); } catch (e) { return; }
      if (view.kind === "board" || entry.task_id === view.id || entry.task_id === view.taskId) {
        if (view.kind === "task") {
          appendEvent(entry);
          // What the diff shows changed: a new submission, a merge, a send-back.
          if (/^(submit|integrated|integration_failed|reject|human_reject|task_)/
            .test(entry.event || "")) loadDiff();
        }
        later(120);
      }
    });
    source.addEventListener("sessions", function () {
      const wait = Math.max(150, 1000 - (Date.now() - lastSessionsRefresh));
      later(wait);
    });
    source.addEventListener("reset", function () { later(0); });
  }
  function later(delay) {
    if (timer) return;
    timer = setTimeout(function () { timer = null; refresh(); }, delay);
  }
  async function refresh() {
    if (busy) { again = true; return; }
    busy = true;
    try {
      lastSessionsRefresh = Date.now();
      if (view.kind === "board") await loadBoard(); else await loadTask();
    } catch (err) { failed(err); }
    finally { busy = false; if (again) { again = false; later(50); } }
  }

  // -- routing: / is the board, /task/ID a task -------------------------------------------
  function route() {
    const match = location.pathname.match(/^\/task\/([^/]+)$/);
    view = match ? {kind: "task", id: decodeURIComponent(match[1])} : {kind: "board"};
    clear(main);
    (view.kind === "board" ? showBoard() : showTask()).catch(failed);
  }
  function go(path) {
    history.pushState(null, "", path);
    route();
    window.scrollTo(0, 0);
  }
  function link(node, path) {
    node.href = path;
    node.addEventListener("click", function (event) {
      if (event.button !== 0 || event.metaKey || event.ctrlKey || event.shiftKey) return;
      event.preventDefault();
      go(path);
    });
    return node;
  }
  window.addEventListener("popstate", route);
  link(document.getElementById("home"), "/");

  // -- the board ---------------------------------------------------------------------------
  async function showBoard() {
    const page = el("div", "board");
    const bar = el("div", "toolbar");
    const form = el("div", "addtask");
    const text = el("textarea");
    text.placeholder = "A new task (its first line is its title)";
    text.setAttribute("aria-label", "new task");
    const queue = el("button", "primary", "Queue task");
    queue.type = "button";
    queue.addEventListener("click", async function () {
      if (!text.value.trim()) { say("Write the task first.", true); return; }
      queue.disabled = true;
      try {
        const done = await api("/api/tasks", {text: text.value});
        text.value = "";
        say(done.message);
        later(0);
      } catch (err) { failed(err); } finally { queue.disabled = false; }
    });
    add(form, text, queue);
    const all = el("label", "muted");
    const box = el("input");
    box.type = "checkbox"; box.checked = showAll;
    box.addEventListener("change", function () { showAll = box.checked; later(0); });
    add(all, box, document.createTextNode(" every ended task"));
    const summary = el("span", "muted summary");
    add(bar, form, all, summary);
    const columns = el("div", "columns");
    add(page, bar, columns);
    main.appendChild(page);
    view.columns = columns; view.summary = summary;
    const data = await loadBoard();
    listen(data.seq);
  }

  async function loadBoard() {
    const data = await api("/api/tasks" + (showAll ? "?all=1" : ""));
    if (view.kind !== "board") return data;
    document.title = "ferrus · " + data.project;
    projectName.textContent = data.project;
    renderColumns(data);
    requestAnimationFrame(function () {
      if (!performance.getEntriesByName("ferrus:board").length) performance.mark("ferrus:board");
    });
    return data;
  }

  function renderColumns(data) {
    const byColumn = {};
    for (const column of data.columns) byColumn[column[0]] = [];
    for (const task of data.tasks) (byColumn[task.column] || byColumn.ended).push(task);
    const frag = document.createDocumentFragment();
    for (const column of data.columns) {
      const tasks = byColumn[column[0]];
      const box = el("div", "column " + column[0]);
      box.dataset.column = column[0];
      const heading = el("h2");
      add(heading, el("span", "", column[1]), el("span", "", tasks.length || ""));
      box.appendChild(heading);
      for (const task of tasks) box.appendChild(card(task, data.human_review));
      frag.appendChild(box);
    }
    clear(view.columns).appendChild(frag);
    view.summary.textContent = !data.older ? "" :
      data.older + " older ended task" + (data.older === 1 ? "" : "s") + " not shown";
  }

  function card(task, humanReview) {
    const node = link(el("a", "card"), taskPath(task.id));
    node.dataset.task = task.id;
    node.dataset.state = task.state_word || "";
    add(node, el("span", "title", task.title || "(no title)"));
    const meta = el("span", "meta");
    if (task.state === "AwaitingHuman") add(meta, el("span", "badge you", "question"));
    if (task.state === "AwaitingConfirmation") add(meta, el("span", "badge you", "approve?"));
    if (task.problem) add(meta, el("span", "badge bad", "damaged"));
    else if (task.column === "ended" || task.column === "merged") {
      add(meta, el("span", "badge", task.state_word));
    } else if (task.state && task.column === "executing" && task.state !== "Executing") {
      add(meta, el("span", "badge", task.state));
    }
    const parts = [task.short_id, task.place || "here"];
    if (task.agent || task.column === "queued") parts.push(task.agent || "no agent yet");
    parts.push(duration(task.elapsed_secs));
    if (task.tokens) parts.push(count(task.tokens) + " tok");
    if (task.cost_usd) parts.push(cost(task.cost_usd));
    add(meta, document.createTextNode(parts.join(" · ")));
    add(node, meta);
    if (task.last_event) add(node, el("span", "last", task.last_event));
    if (task.failure_reason && task.column === "ended") {
      add(node, el("span", "last failed", task.failure_reason));
    }
    return node;
  }

  // -- a task's page ----------------------------------------------------------------------
  async function showTask() {
    const page = el("div", "task");
    const back = link(el("a", "muted", "← the board"), "/");
    const title = el("h1", "", "…");
    const facts = el("div", "facts");
    const you = el("div");
    const actions = el("div", "actions");
    const text = section("Task");
    const events = section("Events");
    const eventList = el("ol", "events");
    events.appendChild(eventList);
    const tools = section("Tool calls");
    const sessions = section("Sessions and usage");
    const logSlot = el("div", "logslot");
    sessions.box.appendChild(logSlot);
    const diff = section("Diff");
    add(page, back, title, facts, you, actions, text.box, events.box, tools.box, sessions.box,
      diff.box);
    main.appendChild(page);
    Object.assign(view, {title: title, facts: facts, you: you, actions: actions, text: text,
      eventList: eventList, tools: tools, sessions: sessions, logSlot: logSlot, diff: diff,
      youKey: null, actionsKey: null, seen: new Set()});
    const data = await loadTask();
    listen(data.seq);
    loadDiff();
  }

  function section(heading) {
    const box = el("section");
    const head = el("h2", "", heading);
    box.appendChild(head);
    const body = el("div");
    box.appendChild(body);
    return {box: box, head: head, body: body,
      appendChild: function (node) { return body.appendChild(node); }};
  }

  async function loadTask() {
    const id = view.id;
    const data = await api("/api/tasks/" + encodeURIComponent(id));
    if (view.kind !== "task" || view.id !== id) return data;
    view.taskId = data.task.id;
    projectName.textContent = data.project;
    renderTask(data);
    return data;
  }

  function renderTask(data) {
    const task = data.task;
    document.title = "ferrus · " + (task.title || task.id);
    view.title.textContent = task.title || task.id;
    clear(view.facts);
    const spent = task.cost_usd === null ? (task.tokens ? "unknown" : "-") : cost(task.cost_usd);
    const facts = [["task", task.id], ["where", task.state_word], ["place", task.place || "here"],
      ["agent", task.agent || "-"], ["age", duration(task.age_secs)],
      ["tokens", count(task.tokens)], ["cost", spent]];
    if (data.state) {
      facts.push(["review cycles", data.state.review_cycles],
        ["check retries", data.state.check_retries]);
    }
    if (task.branch) facts.push(["branch", task.branch]);
    if (task.merged_commit) facts.push(["merged at", task.merged_commit.slice(0, 12)]);
    for (const fact of facts) add(view.facts, el("span", "", fact[0] + ": " + fact[1]));
    if (task.failure_reason) {
      add(view.facts, el("span", "failed", "failed: " + task.failure_reason));
    }
    renderYou(data);
    renderActions(data);
    clear(view.text.body);
    add(view.text.body, el("div", "text", data.text || "(TASK.md is empty)"));
    if (data.submission) {
      add(view.text.body, el("h2", "", "Submission notes"),
        el("div", "text quote", data.submission));
    }
    if (data.review_notes) {
      add(view.text.body, el("h2", "", "Review notes"), el("div", "text quote", data.review_notes));
    }
    renderEvents(data.events);
    renderTools(data.tool_calls);
    renderSessions(data);
  }

  // What waits for the human: a question, or the reviewer's approval to confirm.  Rebuilt
  // only when it changes, so a half-written answer survives every refresh.
  function renderYou(data) {
    const key = JSON.stringify([data.state && data.state.state, data.question, data.confirmation]);
    if (key === view.youKey) return;
    view.youKey = key;
    clear(view.you);
    if (data.actions.answer) {
      const box = add(el("section", "you"), el("h2", "", "An agent asks you"),
        el("div", "text quote question", data.question || ""));
      const answer = el("textarea", "answer");
      answer.setAttribute("aria-label", "your answer");
      const send = el("button", "primary", "Send answer");
      send.type = "button";
      send.addEventListener("click", async function () {
        if (!answer.value.trim()) { say("Write the answer first.", true); return; }
        send.disabled = true;
        try {
          const done = await api("/api/answer", {task: data.task.id, text: answer.value});
          say(done.message); view.youKey = null; later(0);
        } catch (err) { failed(err); send.disabled = false; }
      });
      add(box, answer, add(el("div", "actions"), send));
      view.you.appendChild(box);
    } else if (data.actions.approve) {
      const box = add(el("section", "you"),
        el("h2", "", "The reviewer approved this task: your confirmation"));
      const notes = data.confirmation && data.confirmation.approval_notes;
      add(box, el("div", "muted", "The reviewer's notes:"),
        el("div", "text quote approval", notes || "(no notes given)"));
      if (data.submission) {
        add(box, el("div", "muted", "The submission:"), el("div", "text quote", data.submission));
      }
      add(box, el("div", "muted",
        "Its diff is below. Rejecting sends your notes to the executor as review notes."));
      const approve = el("button", "primary", "Approve");
      approve.type = "button";
      approve.addEventListener("click", async function () {
        if (!window.confirm("Approve task " + short(data.task.id) + "?")) return;
        approve.disabled = true;
        try {
          const done = await api("/api/tasks/" + encodeURIComponent(data.task.id) + "/approve", {});
          say(done.message); view.youKey = null; later(0);
        } catch (err) { failed(err); approve.disabled = false; }
      });
      const notesBox = el("textarea", "reject-notes");
      notesBox.placeholder = "What must change (the executor gets these notes)";
      const reject = el("button", "danger", "Reject with these notes");
      reject.type = "button";
      reject.addEventListener("click", async function () {
        if (!notesBox.value.trim()) {
          say("A rejection needs notes: what must change.", true);
          return;
        }
        reject.disabled = true;
        try {
          const done = await api("/api/tasks/" + encodeURIComponent(data.task.id) + "/reject",
            {notes: notesBox.value});
          say(done.message); view.youKey = null; later(0);
        } catch (err) { failed(err); reject.disabled = false; }
      });
      add(box, add(el("div", "actions"), approve), notesBox, add(el("div", "actions"), reject));
      view.you.appendChild(box);
    }
  }

  function renderActions(data) {
    const key = JSON.stringify([data.actions.cancel, data.actions.retry, data.task.worktree]);
    if (key === view.actionsKey) return;
    view.actionsKey = key;
    clear(view.actions);
    const id = data.task.id;
    function button(label, cls, action) {
      const node = el("button", cls, label);
      node.type = "button";
      node.addEventListener("click", function () {
        node.disabled = true;
        action().finally(function () { node.disabled = false; });
      });
      view.actions.appendChild(node);
    }
    async function cancel(discard) {
      const path = "/api/tasks/" + encodeURIComponent(id) + "/cancel";
      try {
        let done;
        try {
          done = await api(path, {discard: discard});
        } catch (err) {
          // A running task (or dropping its work): the server says what to ask.
          if (!(err.status === 409 && err.data && err.data.confirm)) throw err;
          if (!window.confirm(err.data.confirm)) return;
          done = await api(path, {discard: discard, confirm: true});
        }
        say(done.message); view.actionsKey = null; later(0);
      } catch (err) { failed(err); }
    }
    if (data.actions.cancel) {
      button("Cancel task", "danger", function () { return cancel(false); });
      if (data.task.worktree) {
        button("Cancel and drop its work", "danger", function () { return cancel(true); });
      }
    }
    if (data.actions.retry) {
      button("Retry", "primary", async function () {
        try {
          const done = await api("/api/tasks/" + encodeURIComponent(id) + "/retry", {});
          say(done.message); view.actionsKey = null; later(0);
        } catch (err) { failed(err); }
      });
    }
  }

  function eventLine(entry) {
    const item = el("li");
    item.dataset.seq = entry.seq;
    add(item, el("span", "when", when(entry.time)),
      el("span", "what", String(entry.event || "?").replace(/_/g, " ")));
    if (entry.from !== entry.to && entry.to) {
      add(item, el("span", "moved", (entry.from || "?") + " → " + entry.to));
    }
    add(item, el("span", "who", entry.actor || ""));
    const detail = Object.assign({}, entry.detail || {});
    const checks = Array.isArray(detail.checks) ? detail.checks : null;
    const said = typeof detail.said === "string" ? detail.said : null;
    delete detail.checks; delete detail.said;
    const words = [];
    for (const key of Object.keys(detail)) {
      const value = detail[key];
      if (value === null || value === undefined || value === "") continue;
      words.push(key + "=" + (typeof value === "object" ? JSON.stringify(value) : String(value)));
    }
    if (words.length) add(item, el("span", "detail", words.join("  ")));
    if (said) add(item, el("div", "text quote", said));
    if (checks) {
      for (const check of checks) {
        if (!check || typeof check !== "object") continue;
        const status = String(check.status || "?");
        const secs = typeof check.secs === "number" ? " (" + check.secs.toFixed(1) + "s)" : "";
        const exit = check.exit !== undefined && check.exit !== null && status !== "passed" ?
          " exit " + check.exit : "";
        add(item, el("div", "check " + status,
          status + ": " + (check.command || "?") + exit + secs));
        if (Array.isArray(check.tail) && check.tail.length) {
          add(item, el("pre", "tail", check.tail.join("\n")));
        }
        if (check.log_name) {
          const open = el("button", "", "its log");
          open.type = "button";
          open.addEventListener("click", function () { showLog(check.log_name); });
          add(item, open);
        }
      }
    }
    return item;
  }
  function renderEvents(entries) {
    const list = view.eventList;
    clear(list);
    view.seen = new Set();
    for (const entry of entries) { list.appendChild(eventLine(entry)); view.seen.add(entry.seq); }
    if (!entries.length) {
      list.appendChild(el("li", "muted", "Nothing has happened to this task yet."));
    }
  }
  function appendEvent(entry) {
    if (!view.eventList || view.seen.has(entry.seq)) return;
    view.seen.add(entry.seq);
    const empty = view.eventList.querySelector("li.muted");
    if (empty) empty.remove();
    view.eventList.appendChild(eventLine(entry));
  }

  function renderTools(calls) {
    const body = clear(view.tools.body);
    if (!calls.length) {
      body.appendChild(el("div", "muted", "No tool calls recorded in its sessions' logs."));
      return;
    }
    const list = el("ol", "tools");
    for (const call of calls) {
      const item = el("li", call.ok === false ? "failed" : "",
        (call.slot || "agent") + " ▸ " + call.tool + (call.summary ? "  " + call.summary : ""));
      if (call.reason) add(item, el("div", "quote", call.reason));
      list.appendChild(item);
    }
    body.appendChild(list);
  }

  function renderSessions(data) {
    const body = clear(view.sessions.body);
    const usage = data.usage;
    let spent = usage.cost_usd === null ? (usage.sessions ? "cost unknown" : "$0") :
      cost(usage.cost_usd);
    if (usage.cost_unknown && usage.cost_usd !== null) {
      spent += " + " + usage.cost_unknown + " of unknown cost";
    }
    add(body, el("div", "", usage.sessions + " session" + (usage.sessions === 1 ? "" : "s") +
      ", " + usage.tool_calls + " tool calls, " + count(usage.input_tokens) + " tokens in / " +
      count(usage.output_tokens) + " out, " + spent));
    if (!data.sessions.length) return;
    const table = el("table");
    const head = el("tr");
    for (const name of ["slot", "agent", "model", "started", "outcome", "tools", "tokens",
      "cost", "log"]) head.appendChild(el("th", "", name));
    table.appendChild(head);
    for (const record of data.sessions) {
      const row = el("tr");
      const exit = record.exit_code !== null && record.exit_code !== undefined ?
        " (exit " + record.exit_code + ")" : "";
      const outcome = record.status === "running" ? "running" : (record.outcome || "") + exit;
      const tokens = (record.input_tokens || 0) + (record.output_tokens || 0);
      add(row, el("td", "", record.slot || record.role), el("td", "", record.agent),
        el("td", "", record.model || ""), el("td", "", when(record.started_at)),
        el("td", record.outcome && record.outcome !== "success" ? "failed" : "", outcome),
        el("td", "", record.tool_calls), el("td", "", count(tokens)),
        el("td", "", record.cost_usd === null ? "" : cost(record.cost_usd)));
      const cell = el("td");
      if (record.log_name) {
        const open = el("button", "", "show");
        open.type = "button";
        open.addEventListener("click", function () { showLog(record.log_name); });
        cell.appendChild(open);
      }
      row.appendChild(cell);
      table.appendChild(row);
    }
    body.appendChild(table);
  }

  // A log in windows of 64 KiB (below the sessions, kept across refreshes): its end
  // first, earlier and later parts on demand.
  const LOG_WINDOW = 65536;
  function showLog(name) {
    const box = clear(view.logSlot);
    const bar = el("div", "logbar");
    const info = el("span", "muted", name);
    const earlier = el("button", "", "earlier"), next = el("button", "", "later");
    const end = el("button", "", "end"), close = el("button", "", "close");
    for (const node of [earlier, next, end, close]) node.type = "button";
    const text = el("pre", "log", "…");
    add(bar, info, earlier, next, end, close);
    add(box, bar, text);
    box.scrollIntoView({block: "nearest"});
    let shown = null;
    async function load(offset, length) {
      let query = "";
      if (offset !== undefined) query = "?offset=" + offset + "&length=" + (length || LOG_WINDOW);
      try {
        shown = await api("/api/logs/" + encodeURIComponent(name) + query);
        text.textContent = shown.text || "(empty)";
        info.textContent = name + " — bytes " + shown.offset + "–" +
          (shown.offset + shown.length) + " of " + shown.size + (shown.binary ? " (binary)" : "");
        earlier.disabled = shown.offset === 0;
        next.disabled = shown.offset + shown.length >= shown.size;
        if (offset === undefined) text.scrollTop = text.scrollHeight;
      } catch (err) { failed(err); }
    }
    earlier.addEventListener("click", function () {
      const start = Math.max(0, shown.offset - LOG_WINDOW);
      load(start, shown.offset - start);
    });
    next.addEventListener("click", function () { load(shown.offset + shown.length); });
    end.addEventListener("click", function () { load(); });
    close.addEventListener("click", function () { clear(box); });
    load();
  }

  // -- the diff: per file, collapsible, built when opened ----------------------------------
  let diffRequests = 0;
  async function loadDiff() {
    const body = clear(view.diff.body);
    const reload = el("button", "", "reload");
    reload.type = "button";
    reload.addEventListener("click", loadDiff);
    view.diff.head.textContent = "Diff ";
    view.diff.head.appendChild(reload);
    body.appendChild(el("div", "muted", "loading…"));
    const id = view.id, request = ++diffRequests;
    let data;
    try {
      data = await api("/api/tasks/" + encodeURIComponent(id) + "/diff");
    } catch (err) {
      if (request === diffRequests) clear(body).appendChild(el("div", "failed", err.message));
      return;
    }
    // Only the newest request draws (an older answer may come after it).
    if (view.kind !== "task" || view.id !== id || request !== diffRequests) return;
    renderDiff(clear(body), data);
    requestAnimationFrame(function () {
      if (!performance.getEntriesByName("ferrus:diff").length) performance.mark("ferrus:diff");
    });
  }

  function lineClass(line) {
    if (/^(\+\+\+ |--- |diff --git |index )/.test(line)) return "meta";
    if (line.startsWith("+")) return "add";
    if (line.startsWith("-")) return "del";
    if (line.startsWith("@@")) return "hunk";
    return "";
  }

  function renderDiff(body, data) {
    if (!data.available) {
      add(body, el("div", "", "No diff: " + (data.reason || "none")));
      if (data.hint) add(body, el("div", "muted", "hint: " + data.hint));
      return;
    }
    if (data.title) add(body, el("div", "muted", data.title));
    for (const note of data.notes || []) add(body, el("div", "muted", "note: " + note));
    const lines = String(data.text || "").split("\n");
    const head = [], files = [];
    let current = null;
    for (const line of lines) {
      if (line.startsWith("diff --git ")) {
        current = {header: line.slice(11), lines: [], plus: 0, minus: 0};
        files.push(current);
      }
      if (current) {
        current.lines.push(line);
        if (line.startsWith("+") && !line.startsWith("+++ ")) current.plus++;
        else if (line.startsWith("-") && !line.startsWith("--- ")) current.minus++;
      } else head.push(line);
    }
    const stat = head.join("\n").trim();
    if (stat) add(body, el("pre", "stat", stat));
    if (!files.length) return;
    const openAll = lines.length <= 8000;
    const titles = data.file_titles || [];
    files.forEach(function (file, index) {
      const details = el("details", "file");
      // The board's title: git's quoting undone, control characters made visible.
      const summary = el("summary", "", titles.length === files.length ? titles[index] :
        file.header.replace(/^a\/(.*) b\/\1$/, "$1"));
      add(summary, el("span", "plus", "+" + file.plus), el("span", "minus", "-" + file.minus));
      details.appendChild(summary);
      let built = false;
      const build = function () {
        if (built) return;
        built = true;
        const pre = el("pre", "diff");
        const frag = document.createDocumentFragment();
        for (const line of file.lines) {
          frag.appendChild(el("span", lineClass(line), line.length ? line : " "));
        }
        pre.appendChild(frag);
        details.appendChild(pre);
      };
      details.addEventListener("toggle", function () { if (details.open) build(); });
      if (openAll) { details.open = true; build(); }
      body.appendChild(details);
    });
  }

  route();
})();
"""

WEB_PAGE_TEMPLATE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="referrer" content="no-referrer">
<title>ferrus</title>
<link rel="icon" href="data:,">
<style nonce="@NONCE@">@STYLE@</style>
</head>
<body>
<header><a class="home" id="home" href="/">ferrus</a><span id="project"></span>
<span id="live" class="off">connecting…</span></header>
<main id="main"></main>
<div id="toast" role="status" aria-live="polite"></div>
<script nonce="@NONCE@">@SCRIPT@</script>
</body>
</html>
"""

_WEB_PAGE = WEB_PAGE_TEMPLATE.replace("@STYLE@", WEB_PAGE_STYLE).replace(
    "@SCRIPT@", WEB_PAGE_SCRIPT)


def web_page_html(nonce):
    """The page, its inline script and style carrying ``nonce`` (the CSP's)."""
    return _WEB_PAGE.replace("@NONCE@", nonce)


def _html_text(text):
    """``text`` safe between HTML tags and in quoted attributes."""
    return (str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            .replace('"', "&quot;").replace("'", "&#x27;"))


WEB_SIGNIN_TEMPLATE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="referrer" content="no-referrer">
<title>ferrus: sign in</title>
<link rel="icon" href="data:,">
<style nonce="@NONCE@">body { font: 15px/1.5 system-ui, sans-serif; max-width: 40em;
margin: 3em auto; padding: 0 1em; } code { background: rgba(127,127,127,.15);
padding: 0 .3em; }</style>
</head>
<body>
<h1>ferrus web</h1>
<p>@MESSAGE@</p>
<p>@HINT@</p>
<p>Came here from a link in another app? Browsers hold the board's cookie back on links
from other sites: <a href="">open this page again</a> from here.</p>
</body>
</html>
"""


def web_signin_html(nonce, message, hint=None):
    """The page for a browser without the token (or at a host the board refuses): what
    went wrong and what to do, nothing of the project."""
    values = {"@NONCE@": nonce, "@MESSAGE@": _html_text(message[:1].upper() + message[1:]),
              "@HINT@": _html_text(hint or "")}
    # One pass: a message holding "@HINT@" (it may quote a request) stays as it is.
    return re.sub("@(?:NONCE|MESSAGE|HINT)@", lambda match: values[match.group()],
                  WEB_SIGNIN_TEMPLATE)
