"""The web board as the tests drive it: a board started in-process on a free port, an
HTTP client for it (http.client: the bearer token, the cookie a browser keeps, or
nothing), and a reader of its Server-Sent Events."""

import contextlib
import http.client
import json

import ferrus


@contextlib.contextmanager
def running_board(store, **options):
    """A board serving ``store`` on 127.0.0.1 and a free port, for the with-block."""
    options.setdefault("feed_poll", 0.01)
    board = ferrus.WebBoard(store, "127.0.0.1", 0, **options).start()
    try:
        yield board
    finally:
        board.close()


class Answer:
    def __init__(self, status, headers, raw):
        self.status = status
        self.headers = headers
        self.raw = raw

    @property
    def json(self):
        return json.loads(self.raw.decode("utf-8"))

    @property
    def text(self):
        return self.raw.decode("utf-8", "replace")

    def header(self, name):
        return self.headers.get(name)


class BoardClient:
    """Requests to one board.  ``auth``: "bearer" (a script), "cookie" (the page in a
    browser, with its Origin on POSTs) or None."""

    def __init__(self, board):
        self.board = board
        self.origin = "http://127.0.0.1:%d" % board.port

    def auth_headers(self, auth, method):
        if auth == "bearer":
            return {"Authorization": "Bearer %s" % self.board.token}
        if auth == "cookie":
            headers = {"Cookie": "%s=%s" % (self.board.app.guard.cookie_name, self.board.token)}
            if method == "POST":
                headers.update(Origin=self.origin, **{"Sec-Fetch-Site": "same-origin"})
            return headers
        return {}

    def request(self, method, path, body=None, auth="bearer", headers=None, raw_body=None):
        connection = http.client.HTTPConnection("127.0.0.1", self.board.port, timeout=10)
        sent = self.auth_headers(auth, method)
        data = raw_body
        if body is not None:
            data = json.dumps(body).encode("utf-8")
            sent["Content-Type"] = "application/json"
        sent.update(headers or {})
        try:
            connection.request(method, path, body=data, headers=sent)
            response = connection.getresponse()
            return Answer(response.status, response.headers, response.read())
        finally:
            connection.close()

    def get(self, path, **kw):
        return self.request("GET", path, **kw)

    def post(self, path, body=None, **kw):
        return self.request("POST", path, body={} if body is None else body, **kw)

    def events(self, query="", last_event_id=None, auth="bearer", timeout=5):
        """An open event stream (an EventReader)."""
        connection = http.client.HTTPConnection("127.0.0.1", self.board.port, timeout=timeout)
        headers = self.auth_headers(auth, "GET")
        if last_event_id is not None:
            headers["Last-Event-ID"] = str(last_event_id)
        connection.request("GET", "/api/events" + query, headers=headers)
        return EventReader(connection, connection.getresponse())


class EventReader:
    """Server-Sent Events as they arrive: (event, id, data as JSON or None, comment)."""

    def __init__(self, connection, response):
        self.connection = connection
        self.response = response
        self.status = response.status

    def next(self):
        """The next block of lines: {"event", "id", "data", "comments"}."""
        block = {"event": None, "id": None, "data": None, "comments": []}
        while True:
            line = self.response.fp.readline()
            if not line:
                raise EOFError("the stream ended")
            line = line.decode("utf-8").rstrip("\r\n")
            if not line:
                if block["event"] or block["id"] is not None or block["comments"] or \
                        block["data"] is not None:
                    return block
                continue
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "":
                block["comments"].append(value)
            elif field == "data":
                block["data"] = json.loads(value)
            elif field in ("event", "id"):
                block[field] = value

    def until(self, wanted, limit=200):
        """Blocks up to and including the first that ``wanted`` accepts."""
        seen = []
        for _ in range(limit):
            block = self.next()
            seen.append(block)
            if wanted(block):
                return seen
        raise AssertionError("not seen in %d blocks: %r" % (limit, seen))

    def close(self):
        self.response.close()          # it holds the socket (the stream ends the connection)
        self.connection.close()
