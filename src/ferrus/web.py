"""The web board's server: `ferrus web`, and a board beside `ferrus run` and HQ.

A ThreadingHTTPServer serves the page (web_page.py) and the JSON API (web_api.py) the
page uses; the actions are operations, so the board changes the store only as the CLI
does.  The board is live through Server-Sent Events: one JournalFeed thread per server
stats STATE.json and events.jsonl (as Store waiting does), reads what the journal gained
and hands it to every open stream; a stream resumes from Last-Event-ID, which is the
journal's seq.

WebGuard decides who may talk to the board, on every request and before anything is
read: the access token (a bearer header, or the HttpOnly SameSite=Strict cookie that
`/?token=…` sets before redirecting the token out of the address bar), compared in
constant time; a Host header on the allow-list (DNS rebinding); a same-origin Origin on
every POST, whose body must be JSON (cross-site requests).  Every response carries
nosniff and no-store, the page a strict Content-Security-Policy with a fresh nonce for
its own script and style.  Request lines and headers (http.server's limits), bodies,
connections and streams are bounded.  The server listens on loopback unless --host says
otherwise (with a warning), HTTPS with --tls-cert/--tls-key.  .ferrus/web.json lists the
running boards' addresses (never a token) for [notify] links.  http.server, socket, ssl,
hmac and secrets are imported when a board starts, not with ferrus: every other command
would pay for them at start-up.  Windows: the same, except SIGHUP (there is none).
"""

import argparse
import collections
import contextlib
import json
import os
import re
import signal
import sys
import threading
import time

from .basics import LazyPattern, FerrusError, UsageError, compact_json, log, say
from .store import Store, is_story
from .sessions import SESSIONS_DIR
from .web_link import remove_web_record, write_web_record
from .orchestrator import _raise_terminated
from .web_page import web_page_html, web_signin_html
from .web_api import (WEB_TASK_ACTIONS, WebRefusal, web_answer, web_caller, web_enqueue,
                      web_log_window, web_task_detail, web_task_diff, web_task_listing)


WEB_DEFAULT_HOST = "127.0.0.1"
WEB_DEFAULT_PORT = 8765
WEB_BODY_MAX_BYTES = 1024 * 1024       # a POST body: a task's text, an answer, notes
WEB_CONNECTIONS_MAX = 64               # connections past the token served at once
WEB_UNPROVEN_MAX = 64                  # connections yet to show the token (oldest cut first)
WEB_FIRST_REQUEST_SECS = 10            # to send a first request that shows the token
WEB_STREAMS_MAX = 16                   # event streams open at once
WEB_REQUEST_TIMEOUT_SECS = 30          # a connection silent (or not reading) this long ends
WEB_KEEPALIVE_SECS = 15                # a comment line on a stream where nothing happened
WEB_FEED_POLL_SECS = 0.05              # how often the journal feed stats the store
WEB_SESSIONS_POLL_SECS = 0.5           # how often it stats .ferrus/sessions/
WEB_FEED_KEPT = 2000                   # recent entries kept in memory for resuming streams
WEB_REPLAY_MAX = 1000                  # a stream that missed more is told to reload


# ============================================================================
# Who may talk to the board
# ============================================================================

def web_is_loopback(host):
    """Whether ``host`` (a name or address to bind) is this machine alone."""
    import ipaddress
    if host.lower().rstrip(".") == "localhost":
        return True
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host.strip("[]").split("%")[0]).is_loopback
    return False


def web_is_wildcard(host):
    return host.strip("[]") in ("", "0.0.0.0", "::")


def web_allowed_hosts(bind_host, extra=()):
    """The names a Host header may carry for this board: loopback's, the host it binds
    (for every address: this machine's host name and the addresses it resolves to), and
    ``extra`` (--allow-host, for a name or address other machines reach it by)."""
    import socket
    names = {"localhost", "127.0.0.1", "::1"}
    host = bind_host.strip("[]").lower()
    if web_is_wildcard(host):
        for name in (socket.gethostname(), socket.getfqdn()):
            names.add(name.lower())
            with contextlib.suppress(OSError):
                names.update(info[4][0].lower() for info in socket.getaddrinfo(name, None))
    elif host:
        names.add(host)
    names.update(name.strip("[]").lower().rstrip(".") for name in extra if name)
    names.discard("")
    return frozenset(names)


def web_host_name(header):
    """The host name of a Host header (``name:port``, ``[v6]:port``), lower case; None for
    a header that is not one."""
    if not isinstance(header, str) or not header or len(header) > 255 or \
            any(ch.isspace() or ch in "/@\\" for ch in header):
        return None
    match = re.match(r"^\[([0-9a-fA-F:.]+)\](?::\d{1,5})?$", header) or \
        re.match(r"^([^:\[\]]+)(?::\d{1,5})?$", header)
    return match.group(1).lower().rstrip(".") if match else None


class WebGuard:
    """The board's access checks, applied to every request before anything is read: the
    Host header, the token (bearer or cookie), and the Origin of state-changing ones."""

    def __init__(self, token, allowed_hosts, cookie_name, secure=False):
        self.token = token
        self.allowed_hosts = allowed_hosts
        self.cookie_name = cookie_name
        self.secure = secure

    def token_matches(self, given):
        import hmac
        if not isinstance(given, str) or not given:
            return False
        # Bytes: compare_digest refuses str holding anything but ASCII.
        return hmac.compare_digest(given.encode("utf-8", "replace"), self.token.encode("ascii"))

    def check_host(self, headers):
        header = headers.get("Host")
        name = web_host_name(header)
        if name is None or name not in self.allowed_hosts:
            raise WebRefusal(403, "this board does not answer to the host name %s" % (
                compact_json(header)[:80] if header else "(no Host header)"),
                "open it by an address `ferrus web` printed; another name for this machine "
                "needs `ferrus web --allow-host NAME` (a guard against DNS rebinding)")
        return header

    def cookie_token(self, headers):
        for header in headers.get_all("Cookie") or ():
            for part in header.split(";"):
                name, _, value = part.strip().partition("=")
                if name == self.cookie_name:
                    return value
        return None

    def authenticate(self, headers):
        """How the request proved it holds the token: "bearer", "cookie", or None."""
        authorization = headers.get("Authorization") or ""
        if authorization[:7].lower() == "bearer ":
            return "bearer" if self.token_matches(authorization[7:].strip()) else None
        return "cookie" if self.token_matches(self.cookie_token(headers)) else None

    def check_origin(self, headers, host, scheme, how):
        """A state-changing request must come from the board's own page: its Origin
        (every browser sends one on a POST) must be this board's.  A script that sends
        the bearer token and no Origin is no browser, so no cross-site request."""
        origin = headers.get("Origin")
        fetch_site = headers.get("Sec-Fetch-Site")
        if origin is None and how == "bearer" and fetch_site in (None, "same-origin", "none"):
            return
        expected = "%s://%s" % (scheme, host)
        if origin is None or origin.lower() != expected.lower():
            why = "Origin %s, expected %s" % (
                compact_json(origin)[:80] if origin else "missing", expected)
        elif fetch_site not in (None, "same-origin"):
            why = "the browser's Sec-Fetch-Site says %s, not \"same-origin\"" % (
                compact_json(fetch_site)[:40])
        else:
            return
        raise WebRefusal(403, "refused: a request that changes something must come from "
                         "the board's own page (%s)" % why,
                         "use the page, or send the token as `Authorization: Bearer …` "
                         "without an Origin header from a script")

    def cookie_header(self):
        return "%s=%s; Path=/; HttpOnly; SameSite=Strict%s" % (
            self.cookie_name, self.token, "; Secure" if self.secure else "")


# ============================================================================
# The journal, pushed
# ============================================================================

class JournalFeed:
    """One thread per board that watches the store — a stat of STATE.json and the
    journal every WEB_FEED_POLL_SECS, of .ferrus/sessions/ every WEB_SESSIONS_POLL_SECS
    — and keeps the newest WEB_FEED_KEPT journal entries for the event streams, which
    wait on it instead of each reading the files.  ``generation`` moves on every change
    (new entries, or a session record written: tokens and tool calls to show)."""

    def __init__(self, store, poll=WEB_FEED_POLL_SECS, sessions_poll=WEB_SESSIONS_POLL_SECS,
                 monotonic=time.monotonic):
        self.store = store
        self.poll = poll
        self.sessions_poll = sessions_poll
        self.monotonic = monotonic
        self.kept = collections.deque(maxlen=WEB_FEED_KEPT)
        self.changed = threading.Condition()
        self.generation = 0
        self.sessions_generation = 0
        self.stopped = threading.Event()
        self.position = store.journal_position()   # before the seq: nothing falls between
        self.latest = store.last_journal_seq()
        self.stamp = store.state_stamp()
        self.sessions_stamp = self._sessions_stamp()
        self._sessions_due = 0.0
        self.thread = threading.Thread(target=self._run, name="ferrus-web-feed", daemon=True)

    def start(self):
        self.thread.start()
        return self

    def stop(self):
        self.stopped.set()
        with self.changed:
            self.changed.notify_all()

    def _sessions_stamp(self):
        try:
            info = os.stat(self.store.path(SESSIONS_DIR))
        except OSError:
            return None
        return (info.st_ino, info.st_mtime_ns)

    def _run(self):
        while not self.stopped.wait(self.poll):
            try:
                self.look()
            except Exception:      # a damaged file must not end the board's live view
                log.debug("web: the journal feed could not read the store", exc_info=True)

    def look(self):
        """One look at the store: new journal entries and session records are announced."""
        moved = False
        stamp = self.store.state_stamp()
        if stamp != self.stamp:
            self.stamp = stamp
            entries, self.position = self.store.journal_since(self.position, self.latest)
            if entries:
                with self.changed:
                    self.kept.extend(entries)
                    self.latest = max(self.latest, entries[-1]["seq"])
                moved = True
        now = self.monotonic()
        if now >= self._sessions_due:
            self._sessions_due = now + self.sessions_poll
            sessions = self._sessions_stamp()
            if sessions != self.sessions_stamp:
                self.sessions_stamp = sessions
                self.sessions_generation += 1
                moved = True
        if moved:
            with self.changed:
                self.generation += 1
                self.changed.notify_all()

    def wait(self, generation, timeout):
        """Until ``generation`` is not the feed's any more, ``timeout`` or stop."""
        with self.changed:
            if self.generation == generation and not self.stopped.is_set():
                self.changed.wait(timeout)
            return self.generation

    def entries_after(self, seq):
        """The entries after ``seq``: from memory when it reaches back that far, else read
        from the journal — at most WEB_REPLAY_MAX; None when more were missed (the reader
        reloads instead)."""
        with self.changed:
            latest = self.latest
            if seq >= latest:
                return []
            if self.kept and self.kept[0]["seq"] <= seq + 1:
                return [entry for entry in self.kept if entry["seq"] > seq]
        entries = self.store.read_journal(after_seq=seq, limit=WEB_REPLAY_MAX + 1)
        if len(entries) > WEB_REPLAY_MAX:
            return None
        return [entry for entry in entries if entry["seq"] <= latest]


def _sse_message(event, data, event_id=None):
    lines = []
    if event_id is not None:
        lines.append("id: %d" % event_id)
    lines.append("event: %s" % event)
    # compact_json escapes newlines, so the data is one line.
    lines.append("data: %s" % compact_json(data))
    return ("\n".join(lines) + "\n\n").encode("utf-8")


# ============================================================================
# The board's HTTP application
# ============================================================================

class WebRequest:
    """One request as the app sees it (built by the HTTP handler, or by a test)."""

    def __init__(self, method, target, headers, read_body, scheme="http", admit=None):
        import urllib.parse
        self.method = method
        parts = urllib.parse.urlsplit(target)
        self.path = urllib.parse.unquote(parts.path)
        self.query = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
        self.headers = headers
        self.read_body = read_body          # callable(limit) -> bytes; WebRefusal(413)
        self.scheme = scheme
        # callable() -> bool, called once the request showed the token: may its
        # connection be served (False: the board serves as many as it will)?
        self.admit = admit or (lambda: True)

    def param(self, name):
        values = self.query.get(name)
        return values[-1] if values else None


class WebResponse:
    def __init__(self, status, body=b"", content_type=None, headers=(), stream=None):
        self.status = status
        self.body = body
        self.headers = [("Content-Type", content_type)] if content_type else []
        self.headers += list(headers)
        self.stream = stream                # an iterator of bytes: an event stream


def _json_body(value):
    # "<" escaped too: the JSON stays inert if anything ever took it for HTML.
    return compact_json(value).replace("<", "\\u003c").encode("utf-8")


def web_json(status, value, headers=()):
    return WebResponse(status, _json_body(value), "application/json; charset=utf-8", headers)


def _page_nonce():
    import base64
    return base64.b64encode(os.urandom(18)).decode("ascii")


def web_content_policy(nonce):
    """The page's Content-Security-Policy: its own inline script and style (this
    response's nonce) and requests to itself, nothing else."""
    return ("default-src 'none'; script-src 'nonce-%s'; style-src 'nonce-%s'; "
            "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
            "frame-ancestors 'none'" % (nonce, nonce))


# Headers on every response.
WEB_COMMON_HEADERS = (("X-Content-Type-Options", "nosniff"), ("Cache-Control", "no-store"),
                      ("Referrer-Policy", "no-referrer"), ("X-Frame-Options", "DENY"),
                      ("Cross-Origin-Opener-Policy", "same-origin"),
                      ("Cross-Origin-Resource-Policy", "same-origin"))
_WEB_TOKEN_IN_URL = LazyPattern(r"([?&]token=)[^&\s]*")
_TASK_ROUTE = LazyPattern(r"^/api/tasks/([^/]{1,100})(?:/(diff|cancel|retry|approve|reject))?$")
_LOG_ROUTE = LazyPattern(r"^/api/logs/([^/]{1,201})$")
_PAGE_ROUTE = LazyPattern(r"^/(?:task/[^/]{1,100})?$")


class WebApp:
    """Routes a WebRequest to a WebResponse: the guard first, then the page, the API or
    an event stream.  Thread-safe: each request reads the store on its own."""

    def __init__(self, store, guard, feed, keepalive=WEB_KEEPALIVE_SECS,
                 max_streams=WEB_STREAMS_MAX):
        self.store = store
        self.guard = guard
        self.feed = feed
        self.keepalive = keepalive
        self.max_streams = max_streams
        self.streams = 0
        self._streams_lock = threading.Lock()
        self.closing = threading.Event()

    def handle(self, request):
        page = request.method in ("GET", "HEAD") and bool(_PAGE_ROUTE.match(request.path))
        try:
            response = self._handle(request, page)
        except WebRefusal as refusal:
            response = self._refusal(refusal, page)
        except FerrusError as err:
            response = self._refusal(WebRefusal(409, err.message, err.hint), page)
        except OSError as err:
            # A full disk or a read-only file mid-operation: the atomic writes left the
            # previous state intact, as the CLI says.
            response = self._refusal(WebRefusal(500, "%s%s" % (err.strerror or err, (
                " (%s)" % err.filename) if err.filename else ""), "each file in .ferrus/ is "
                "replaced whole; free space or fix permissions and try again"), page)
        response.headers += list(WEB_COMMON_HEADERS)
        return response

    def _refusal(self, refusal, page):
        headers = [("WWW-Authenticate", 'Bearer realm="ferrus"')] if refusal.status == 401 else []
        if page and refusal.status in (401, 403):
            nonce = _page_nonce()
            return WebResponse(refusal.status, web_signin_html(
                nonce, refusal.message, refusal.hint).encode("utf-8"),
                "text/html; charset=utf-8",
                headers + [("Content-Security-Policy", web_content_policy(nonce))])
        body = dict(refusal.fields, error=refusal.message, hint=refusal.hint)
        return web_json(refusal.status, body, headers)

    def _handle(self, request, page):
        host = self.guard.check_host(request.headers)
        token = request.param("token")
        if page and token is not None:
            return self._sign_in(request, token)
        how = self.guard.authenticate(request.headers)
        if how is None:
            raise WebRefusal(401, "this board needs its access token", "open the URL "
                             "`ferrus web` printed (it ends in ?token=…) once in this browser; "
                             "a script sends `Authorization: Bearer TOKEN`")
        _admit(request)
        if page:
            nonce = _page_nonce()
            return WebResponse(200, web_page_html(nonce).encode("utf-8"),
                               "text/html; charset=utf-8",
                               [("Content-Security-Policy", web_content_policy(nonce))])
        if request.method == "POST":
            self.guard.check_origin(request.headers, host, request.scheme, how)
            return self._post(request)
        if request.method not in ("GET", "HEAD"):
            raise WebRefusal(405, "%s is not a method this board answers" % request.method[:20],
                             "GET reads, POST acts")
        return self._get(request)

    def _sign_in(self, request, token):
        """``?token=`` on a page: the cookie is set and the browser sent to the same page
        without the token, so it leaves the address bar and the history."""
        import urllib.parse
        if not self.guard.token_matches(token):
            raise WebRefusal(401, "this access token is not the board's", "`ferrus web` "
                             "prints a new URL each time it starts; open the latest")
        _admit(request)
        query = [(k, v) for k, values in request.query.items() if k != "token" for v in values]
        location = urllib.parse.quote(request.path) + (
            "?" + urllib.parse.urlencode(query) if query else "")
        return WebResponse(303, b"", None, [("Location", location),
                                            ("Set-Cookie", self.guard.cookie_header())])

    # -- reading ---------------------------------------------------------------------------

    def _get(self, request):
        path = request.path
        if path == "/api/events":
            return self._events(request)
        if path == "/api/tasks":
            return web_json(200, web_task_listing(self.store, request.param("all") in
                                                  ("1", "true")))
        match = _TASK_ROUTE.match(path)
        if match and match.group(2) in (None, "diff"):
            if match.group(2) == "diff":
                return web_json(200, web_task_diff(self.store, match.group(1)))
            return web_json(200, web_task_detail(self.store, match.group(1)))
        match = _LOG_ROUTE.match(path)
        if match:
            return web_json(200, web_log_window(self.store, match.group(1),
                                                _number_param(request, "offset"),
                                                _number_param(request, "length")))
        if match is None and _TASK_ROUTE.match(path):
            raise WebRefusal(405, "%s takes POST" % path, "the page's buttons send it")
        raise WebRefusal(404, "nothing at %s" % path[:100], "the API is /api/tasks, "
                         "/api/tasks/ID, /api/tasks/ID/diff, /api/logs/NAME and /api/events")

    # -- acting ----------------------------------------------------------------------------

    def _post(self, request):
        match = _TASK_ROUTE.match(request.path)
        if request.path not in ("/api/tasks", "/api/answer") and not (
                match and match.group(2) in WEB_TASK_ACTIONS):
            raise WebRefusal(404 if not match else 405, "nothing to POST to at %s"
                             % request.path[:100], "actions are POST /api/tasks, /api/answer "
                             "and /api/tasks/ID/cancel|retry|approve|reject")
        body = self._json_of(request)
        caller = web_caller()
        if request.path == "/api/tasks":
            status, answer = web_enqueue(self.store, caller, body)
        elif request.path == "/api/answer":
            status, answer = web_answer(self.store, caller, body)
        else:
            status, answer = WEB_TASK_ACTIONS[match.group(2)](self.store, caller,
                                                               match.group(1), body)
        return web_json(status, answer)

    def _json_of(self, request):
        kind = (request.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if kind != "application/json":
            raise WebRefusal(415, "send the request's body as application/json (it was %s)"
                             % (compact_json(kind)[:60] if kind else "not typed"),
                             "a form post from another site cannot be JSON, so this is "
                             "required")
        raw = request.read_body(WEB_BODY_MAX_BYTES)
        try:
            body = json.loads(raw.decode("utf-8")) if raw.strip() else {}
        except (ValueError, UnicodeDecodeError, RecursionError) as err:
            raise WebRefusal(400, "the body is not JSON: %s" % str(err)[:120]) from None
        if not isinstance(body, dict):
            raise WebRefusal(400, "the body must be a JSON object")
        return body

    # -- the event stream ------------------------------------------------------------------

    def _events(self, request):
        """GET /api/events: Server-Sent Events of the journal from Last-Event-ID (or
        ?after=SEQ; else from now on), ``journal`` events with the entry as data and its
        seq as id, ``sessions`` when a session record changed, ``reset`` when the stream
        missed too much to replay (reload, then go on)."""
        after = _seq_of(request.headers.get("Last-Event-ID"))
        if after is None:
            after = _seq_of(request.param("after"))
        task = request.param("task")
        everything = request.param("all") in ("1", "true")
        with self._streams_lock:
            if self.streams >= self.max_streams:
                raise WebRefusal(503, "%d event streams are open (at most %d)" % (
                    self.streams, self.max_streams), "close other tabs of this board")
            self.streams += 1
        return WebResponse(200, b"", "text/event-stream; charset=utf-8",
                           [("X-Accel-Buffering", "no")],
                           stream=WebStream(self._stream(after, task, everything),
                                            self._stream_ended))

    def _stream_ended(self):
        with self._streams_lock:
            self.streams -= 1

    def _stream(self, after, task, everything):
        end = self.store.last_journal_seq()
        # "From now" is the journal's end, which the feed may not have read yet.
        last = end if after is None or after > end else after
        yield b": ferrus journal\nretry: 2000\n\n" + (
            # Past the journal's end: a journal restored from a backup, or another one.
            _sse_message("reset", {"seq": end}, end) if after is not None and after > end
            else b"")
        generation, sessions = -1, self.feed.sessions_generation
        quiet_since = time.monotonic()
        while not self.closing.is_set():
            generation = self.feed.wait(generation, self.keepalive)
            if self.closing.is_set():
                return
            out = []
            entries = self.feed.entries_after(last)
            if entries is None:
                last = self.feed.latest
                out.append(_sse_message("reset", {"seq": last}, last))
            else:
                for entry in entries:
                    if (everything or is_story(entry)) and \
                            (task is None or entry.get("task_id") == task):
                        out.append(_sse_message("journal", entry, entry["seq"]))
                    last = entry["seq"]
                if entries and not out:
                    out.append(b"id: %d\n\n" % last)      # moves Last-Event-ID on
            if self.feed.sessions_generation != sessions:
                sessions = self.feed.sessions_generation
                out.append(_sse_message("sessions", {"generation": sessions}))
            if not out and time.monotonic() - quiet_since >= self.keepalive:
                out.append(b": keep-alive\n\n")
            if out:
                quiet_since = time.monotonic()
                yield b"".join(out)


def _admit(request):
    """A request that showed the token moves its connection among those the board serves
    (WEB_CONNECTIONS_MAX of them); connections that never show it cannot take their place."""
    if not request.admit():
        raise WebRefusal(503, "the board serves %d connections already" % WEB_CONNECTIONS_MAX,
                         "close a tab or a script's connections to it, then try again")


class WebStream:
    """An event stream's chunks, and what to do once it ends — however it ends (the client
    left, the board closes, or it never started: a generator's own ``finally`` would not
    run then)."""

    def __init__(self, chunks, on_end):
        self.chunks = chunks
        self.on_end = on_end
        self.ended = False

    def __iter__(self):
        return self.chunks

    def close(self):
        self.chunks.close()
        if not self.ended:
            self.ended = True
            self.on_end()


def _seq_of(text):
    if text is None:
        return None
    text = text.strip()
    return int(text) if text.isdigit() and len(text) <= 18 else None


def _number_param(request, name):
    value = request.param(name)
    if value is None:
        return None
    if not value.isdigit() or len(value) > 18:
        raise WebRefusal(400, "%s must be a number of bytes, not %s" % (name, compact_json(
            value)[:40]))
    return int(value)


# ============================================================================
# The HTTP server
# ============================================================================

def _web_server_classes():
    """(the server class for IPv4, for IPv6, the ssl module or None): made on first use,
    so http.server and ssl are imported only by a process that serves a board."""
    cached = getattr(_web_server_classes, "cached", None)
    if cached is not None:
        return cached
    import http.server
    import socket
    import socketserver
    try:
        import ssl
    except ImportError:                 # a Python built without OpenSSL: HTTP only
        ssl = None
    tls_socket = ssl.SSLSocket if ssl is not None else ()
    tls_errors = (ssl.SSLError,) if ssl is not None else ()

    class BoardHandler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "ferrus-web"
        sys_version = ""

        def setup(self):
            self.timeout = WEB_FIRST_REQUEST_SECS       # until a request shows the token
            super().setup()
            if isinstance(self.connection, tls_socket):
                self.connection.do_handshake()      # here, on this thread, not in accept()

        def handle(self):
            with contextlib.suppress(ConnectionError, socket.timeout, OSError, *tls_errors):
                super().handle()

        def log_message(self, format, *args):
            # The request line of a sign-in carries the token: never logged.
            log.debug("web: %s %s", self.address_string(),
                      _WEB_TOKEN_IN_URL.sub(r"\1…", format % args))

        def read_body(self, limit):
            """The request's body, at most ``limit`` bytes (else WebRefusal, unread)."""
            length = (self.headers.get("Content-Length") or "").strip()
            self.body_unread = False
            if self.headers.get("Transfer-Encoding"):
                self.close_connection = True
                raise WebRefusal(411, "send the body with a Content-Length, not chunked")
            if not length.isdigit():
                self.close_connection = True
                raise WebRefusal(411, "a body needs a Content-Length header")
            if int(length) > limit:
                self.close_connection = True        # what follows is never read
                raise WebRefusal(413, "the body has %s bytes; at most %d are accepted"
                                 % (length, limit))
            return self.rfile.read(int(length))

        def admit(self):
            if not self.server.admit(self.connection):
                self.close_connection = True
                return False
            self.connection.settimeout(WEB_REQUEST_TIMEOUT_SECS)
            return True

        def serve(self):
            self.body_unread = bool(self.headers.get("Transfer-Encoding")) or \
                self.headers.get("Content-Length", "0").strip() not in ("", "0")
            scheme = "https" if isinstance(self.connection, tls_socket) else "http"
            response = self.server.app.handle(WebRequest(self.command, self.path, self.headers,
                                                         self.read_body, scheme, self.admit))
            if self.body_unread:
                self.close_connection = True        # a body nobody read: end the connection
            self.send_response(response.status)
            for name, value in response.headers:
                self.send_header(name, value)
            if response.stream is None:
                if self.close_connection:
                    self.send_header("Connection", "close")
                self.send_header("Content-Length", str(len(response.body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(response.body)
                return
            self.send_header("Connection", "close")   # an event stream ends the connection
            self.end_headers()
            self.wfile.flush()
            try:
                for chunk in response.stream if self.command != "HEAD" else ():
                    self.wfile.write(chunk)
                    self.wfile.flush()
            finally:
                response.stream.close()

        do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = serve

    class BoardServer(http.server.ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 32

        def __init__(self, address, app):
            self.app = app
            self.admitted = set()       # connections that showed the token
            self.unproven = collections.OrderedDict()   # the others, oldest first
            self._active_lock = threading.Lock()
            super().__init__(address, BoardHandler)

        def server_bind(self):
            # HTTPServer's own looks the address up in DNS (getfqdn), which can hang;
            # nothing here needs the name it finds.
            socketserver.TCPServer.server_bind(self)

        # A connection is unproven until one of its requests shows the token, then
        # admitted (at most WEB_CONNECTIONS_MAX at once).  Anyone who can reach the port
        # can open connections, so the unproven ones are bounded on their own: a new one
        # beyond WEB_UNPROVEN_MAX cuts the oldest, and each has WEB_FIRST_REQUEST_SECS
        # of silence — idle sockets cannot lock out the holder of the token.
        def process_request(self, request, client_address):
            with self._active_lock:
                self.unproven[request] = True
                oldest = self.unproven.popitem(last=False)[0] \
                    if len(self.unproven) > WEB_UNPROVEN_MAX else None
            if oldest is not None:
                with contextlib.suppress(OSError):      # its thread reads the end and goes
                    socket.socket.shutdown(oldest, socket.SHUT_RDWR)
            try:
                super().process_request(request, client_address)
            except BaseException:
                self._forget(request)
                raise

        def admit(self, request):
            """May ``request`` (a connection that showed the token) be served?"""
            with self._active_lock:
                if request not in self.unproven:
                    return request in self.admitted
                if len(self.admitted) >= WEB_CONNECTIONS_MAX:
                    return False
                del self.unproven[request]
                self.admitted.add(request)
                return True

        @property
        def active(self):
            """How many connections are served (all of them, proven or not)."""
            with self._active_lock:
                return len(self.admitted) + len(self.unproven)

        def _forget(self, request):
            with self._active_lock:
                self.unproven.pop(request, None)
                self.admitted.discard(request)

        def process_request_thread(self, request, client_address):
            try:
                super().process_request_thread(request, client_address)
            finally:
                self._forget(request)

        def handle_error(self, request, client_address):
            log.debug("web: a request from %s failed", client_address, exc_info=True)

    class BoardServer6(BoardServer):
        address_family = socket.AF_INET6

    _web_server_classes.cached = (BoardServer, BoardServer6, ssl)
    return _web_server_classes.cached


class WebBoard:
    """A running board: its server thread, journal feed and .ferrus/web.json.

    ``url`` is the address to open (with the token); ``base_url`` the same without it.
    ``options`` is how the command's options start in messages ("--web-" beside `ferrus
    run` and HQ).  close() stops the server and its streams and takes its entry out of web.json."""

    def __init__(self, store, host=WEB_DEFAULT_HOST, port=WEB_DEFAULT_PORT, tls_cert=None,
                 tls_key=None, allow_hosts=(), feed_poll=WEB_FEED_POLL_SECS,
                 keepalive=WEB_KEEPALIVE_SECS, options="--"):
        import secrets
        self.store = store
        self.token = secrets.token_urlsafe(32)
        self.tls = bool(tls_cert)
        server4, server6, ssl = _web_server_classes()
        context = None
        if tls_cert or tls_key:
            context = _tls_context(ssl, tls_cert, tls_key, options)
        self.feed = JournalFeed(store, poll=feed_poll)
        server_class = server6 if ":" in host else server4
        try:
            # The app is set once the port is known (the cookie is named after it).
            self.server = server_class((host.strip("[]"), port), None)
        except OSError as err:
            raise FerrusError("cannot listen on %s port %d: %s" % (
                host, port, err.strerror or err), "%sport 0 picks a free port; %shost "
                "names an address of this machine" % (options, options)) from err
        if context is not None:
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True,
                                                     do_handshake_on_connect=False)
        self.port = self.server.server_address[1]
        guard = WebGuard(self.token, web_allowed_hosts(host, allow_hosts),
                         "ferrus_web_%d" % self.port, secure=self.tls)
        self.app = self.server.app = WebApp(store, guard, self.feed, keepalive=keepalive)
        shown = host if not web_is_wildcard(host) else _this_machine_name()
        if ":" in shown:
            shown = "[%s]" % shown.strip("[]")
        self.base_url = "%s://%s:%d" % ("https" if self.tls else "http", shown, self.port)
        self.url = "%s/?token=%s" % (self.base_url, self.token)
        self._thread = None

    def start(self):
        self.feed.start()
        self._thread = threading.Thread(target=self.server.serve_forever,
                                        kwargs={"poll_interval": 0.05},
                                        name="ferrus-web", daemon=True)
        self._thread.start()
        with contextlib.suppress(OSError):
            write_web_record(self.store, self.base_url)
        return self

    def close(self):
        self.app.closing.set()
        self.feed.stop()
        if self._thread is not None:
            self.server.shutdown()
            self._thread.join(10)
        self.server.server_close()
        remove_web_record(self.store, self.base_url)


def _this_machine_name():
    import socket
    return socket.gethostname() or "localhost"


def _tls_context(ssl, cert, key, options="--"):
    both = "%stls-cert CERT.pem %stls-key KEY.pem" % (options, options)
    if not cert:
        raise UsageError("%stls-key needs %stls-cert" % (options, options), "give both: " + both)
    if ssl is None:
        raise FerrusError("this Python has no ssl module, so the board cannot serve HTTPS",
                          "use a Python built with OpenSSL, or an ssh tunnel to a board on "
                          "loopback (`ssh -L 8765:127.0.0.1:8765 HOST`)")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as err:
        raise FerrusError("cannot use the TLS certificate %s%s: %s" % (
            cert, " with key %s" % key if key else "", getattr(err, "strerror", None) or err),
            "give a PEM certificate (chain) and its private key: " + both) from err
    return context


# ============================================================================
# `ferrus web`, and a board beside `ferrus run` and HQ
# ============================================================================

def web_warnings(host, tls, options="--"):
    """What `ferrus web` says before it listens beyond this machine."""
    if web_is_loopback(host):
        return []
    lines = ["ferrus: warning: the board listens on %s, so other machines can reach it; "
             "whoever opens it with the token acts as you (queues, cancels, approves)." % host]
    if not tls:
        lines.append("ferrus: warning: without %stls-cert/%stls-key its traffic is plain "
                     "HTTP — the token and everything on the board cross the network "
                     "readable; securing it is yours." % (options, options))
    lines.append("hint: from a phone or another machine, prefer an ssh tunnel to a board on "
                 "loopback: `ssh -L 8765:127.0.0.1:8765 THIS-HOST`, then open "
                 "http://127.0.0.1:8765/?token=… there")
    return lines


def start_web_beside(store, host, port, out, tls_cert=None, tls_key=None, allow_hosts=()):
    """A board serving ``store`` while `ferrus run` or HQ works (their --web): started on
    threads of this process, its URL and any warning given to ``out``; the caller calls
    .close() when it ends."""
    for line in web_warnings(host, bool(tls_cert), options="--web-"):
        out(line)
    board = WebBoard(store, host, port, tls_cert, tls_key, allow_hosts,
                     options="--web-").start()
    out("ferrus web: the board is at %s" % board.url)
    return board


def _port(text):
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError("a port is a number from 0 to 65535 (0: a free one), "
                                         "not %r" % text)
    return value


def add_web_options(parser, prefix=""):
    """--host, --port, --allow-host, --tls-cert, --tls-key (``prefix`` "web-" for `ferrus
    run` and HQ, whose own --web starts the board)."""
    parser.add_argument("--%shost" % prefix, metavar="ADDR", default=WEB_DEFAULT_HOST,
                        help="the address to listen on (default %s, this machine only; "
                             "anything else prints a warning)" % WEB_DEFAULT_HOST)
    parser.add_argument("--%sport" % prefix, metavar="PORT", type=_port,
                        default=WEB_DEFAULT_PORT,
                        help="the port (default %d; 0 picks a free one)" % WEB_DEFAULT_PORT)
    parser.add_argument("--%sallow-host" % prefix, metavar="NAME", action="append",
                        default=[], help="another host name browsers reach the board by "
                                         "(the Host header must be one the board knows)")
    parser.add_argument("--%stls-cert" % prefix, metavar="PEM",
                        help="serve HTTPS with this certificate (chain)")
    parser.add_argument("--%stls-key" % prefix, metavar="PEM",
                        help="the certificate's private key (when not in --%stls-cert)" % prefix)


def add_web_parser(sub):
    """`ferrus web` on the top-level subparsers."""
    p = sub.add_parser("web", help="the task board in a browser: watch, queue, answer, "
                                   "approve (prints a URL with an access token)")
    add_web_options(p)
    p.set_defaults(run=cmd_web)
    return p


def cmd_web(args, root):
    store = Store(root).require()
    for line in web_warnings(args.host, bool(args.tls_cert)):
        say(line, file=sys.stderr)
    board = WebBoard(store, args.host, args.port, args.tls_cert, args.tls_key,
                     args.allow_host)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        # SIGTERM and SIGHUP end it as Ctrl+C does, so web.json goes with it.
        for name in ("SIGTERM", "SIGHUP"):
            number = getattr(signal, name, None)
            if number is not None:
                previous[number] = signal.signal(number, _raise_terminated)
    try:
        board.start()
        say("ferrus web: serving %s" % store.root)
        say("    %s" % board.url, flush=True)
        say("Open that URL once in your browser (it keeps a cookie and drops the token from "
            "the address); Ctrl+C stops the board.", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt as interrupt:
        return getattr(interrupt, "exit_code", 0)
    finally:
        board.close()
        for number, handler in previous.items():
            signal.signal(number, handler)
