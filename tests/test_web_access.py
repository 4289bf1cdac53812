"""Who may talk to the web board (`ferrus web`): the access token on every request
(bearer, or the HttpOnly SameSite=Strict cookie that ?token= sets), compared in constant
time; the Host header allow-list against DNS rebinding; the board's own Origin and a
JSON body on every POST; bounded bodies, connections and event streams; the headers
every answer carries; HTTPS with --tls-cert/--tls-key."""

import hmac
import http.client
import shutil
import socket
import ssl
import subprocess
import time

import pytest

import ferrus
from web_client import BoardClient, running_board


QUEUE = "/api/tasks"


@pytest.fixture
def board(store):
    with running_board(store) as running:
        yield running


@pytest.fixture
def client(board):
    return BoardClient(board)


def queued_titles(store):
    return [row["title"] for row in ferrus.task_rows(store)]


# -- the token ------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/api/tasks", "/api/events", "/api/tasks/abcdef",
                                  "/api/tasks/abcdef/diff", "/api/logs/check.log"])
def test_every_api_read_needs_the_token(client, path):
    for auth, headers in ((None, {}), (None, {"Authorization": "Bearer not-the-token"}),
                          (None, {"Cookie": "%s=nope" % client.board.app.guard.cookie_name}),
                          (None, {"Authorization": "Basic %s" % client.board.token})):
        answer = client.get(path, auth=auth, headers=headers)
        assert answer.status == 401, (path, headers)
        assert answer.json["error"] == "this board needs its access token"
        assert "?token=" in answer.json["hint"]
        assert answer.header("WWW-Authenticate") == 'Bearer realm="ferrus"'


def test_an_action_without_the_token_changes_nothing(client, store):
    answer = client.post(QUEUE, {"text": "Sneaky task"}, auth=None,
                         headers={"Origin": client.origin})
    assert answer.status == 401
    assert queued_titles(store) == []


def test_the_bearer_token_and_the_cookie_both_open_the_api(client):
    assert client.get(QUEUE, auth="bearer").status == 200
    assert client.get(QUEUE, auth="cookie").status == 200


def test_a_page_without_the_token_says_how_to_sign_in_and_shows_nothing_of_the_project(
        client, store):
    ferrus.op_enqueue_task(store, ferrus.HUMAN, "Secret plans")
    answer = client.get("/", auth=None)
    assert answer.status == 401
    assert answer.header("Content-Type") == "text/html; charset=utf-8"
    assert "needs its access token" in answer.text and "?token=" in answer.text
    assert "Secret plans" not in answer.text and "/api/" not in answer.text
    # The sign-in page is inert too: its only style carries the response's nonce.
    nonce = answer.header("Content-Security-Policy").split("'nonce-")[1].split("'")[0]
    assert '<style nonce="%s">' % nonce in answer.text and "<script" not in answer.text


def test_the_token_in_the_address_becomes_a_strict_httponly_cookie_and_leaves_the_address(
        client, board):
    answer = client.get("/task/3fa2c1?token=%s&tab=diff" % board.token, auth=None)
    assert answer.status == 303
    assert answer.header("Location") == "/task/3fa2c1?tab=diff"        # the token is gone
    cookie = answer.header("Set-Cookie")
    assert cookie == "ferrus_web_%d=%s; Path=/; HttpOnly; SameSite=Strict" % (
        board.port, board.token)
    page = client.get("/", auth=None, headers={"Cookie": cookie.split(";")[0]})
    assert page.status == 200 and "<script nonce=" in page.text


def test_a_wrong_token_in_the_address_sets_no_cookie(client, board):
    answer = client.get("/?token=%s" % board.token[:-1], auth=None)
    assert answer.status == 401 and answer.header("Set-Cookie") is None
    assert "This access token is not the board" in answer.text


def test_tokens_are_compared_in_constant_time(board, monkeypatch):
    compared, real = [], hmac.compare_digest

    def spy(a, b):
        compared.append((type(a), type(b)))
        return real(a, b)
    monkeypatch.setattr(hmac, "compare_digest", spy)
    guard = board.app.guard
    assert guard.token_matches(board.token)
    assert not guard.token_matches("é" + board.token[1:])     # not ASCII: still compared
    assert not guard.token_matches("")
    assert compared == [(bytes, bytes), (bytes, bytes)]


def test_each_board_has_its_own_long_random_token(store):
    with running_board(store) as one, running_board(store) as two:
        assert one.token != two.token and len(one.token) >= 40
        assert one.app.guard.cookie_name != two.app.guard.cookie_name


# -- the Host header -------------------------------------------------------------------------

@pytest.mark.parametrize("host", ["evil.example", "evil.example:8765", "127.0.0.1.evil.example",
                                  "localhost@evil.example", "", "[::2]:80", "local host"])
def test_a_host_header_the_board_does_not_know_is_refused_even_with_the_token(client, host):
    answer = client.get(QUEUE, headers={"Host": host})
    assert answer.status == 403
    assert "does not answer to the host name" in answer.json["error"]
    assert "--allow-host" in answer.json["hint"]


@pytest.mark.parametrize("host", ["localhost", "localhost:1234", "LOCALHOST.", "127.0.0.1:9",
                                  "[::1]:8765"])
def test_loopback_host_names_with_any_port_are_the_boards(client, host):
    # Any port: an ssh tunnel (`ssh -L 9000:127.0.0.1:8765`) keeps the name, not the port.
    assert client.get(QUEUE, headers={"Host": host}).status == 200


def test_a_request_without_a_host_header_is_refused(board):
    with socket.create_connection(("127.0.0.1", board.port), timeout=5) as sock:
        sock.sendall(b"GET /api/tasks HTTP/1.0\r\nAuthorization: Bearer %s\r\n\r\n"
                     % board.token.encode())
        head = sock.recv(65536).split(b"\r\n", 1)[0]
    assert head.startswith(b"HTTP/1.1 403")


def test_allow_host_adds_a_name(store):
    with running_board(store, allow_hosts=("board.lan", "Phone.Example.")) as board:
        client = BoardClient(board)
        assert client.get(QUEUE, headers={"Host": "board.lan:8765"}).status == 200
        assert client.get(QUEUE, headers={"Host": "phone.example"}).status == 200
        assert client.get(QUEUE, headers={"Host": "other.lan"}).status == 403


def test_the_allowed_names_follow_the_address_the_board_listens_on():
    assert ferrus.web_allowed_hosts("127.0.0.1") == {"localhost", "127.0.0.1", "::1"}
    assert "192.0.2.7" in ferrus.web_allowed_hosts("192.0.2.7")
    everywhere = ferrus.web_allowed_hosts("0.0.0.0")
    assert socket.gethostname().lower() in everywhere


# -- the Origin of actions ---------------------------------------------------------------------

def test_an_action_from_the_page_needs_the_boards_own_origin(client, store):
    cookie = {"Cookie": "%s=%s" % (client.board.app.guard.cookie_name, client.board.token)}
    refused = [
        dict(cookie),                                                   # no Origin at all
        dict(cookie, Origin="http://evil.example"),
        dict(cookie, Origin="http://127.0.0.1:%d.evil.example" % client.board.port),
        dict(cookie, Origin="https://127.0.0.1:%d" % client.board.port),   # another scheme
        dict(cookie, Origin="null"),
        dict(cookie, Origin=client.origin, **{"Sec-Fetch-Site": "cross-site"}),
        dict(cookie, Origin=client.origin, **{"Sec-Fetch-Site": "same-site"}),
    ]
    for headers in refused:
        answer = client.post(QUEUE, {"text": "Cross-site task"}, auth=None, headers=headers)
        assert answer.status == 403, headers
        assert "must come from the board's own page" in answer.json["error"]
    assert queued_titles(store) == []
    # The right Origin from another site: the message names what was wrong.
    answer = client.post(QUEUE, {"text": "Cross-site task"}, auth=None, headers=dict(
        cookie, Origin=client.origin, **{"Sec-Fetch-Site": "cross-site"}))
    assert 'Sec-Fetch-Site says "cross-site", not "same-origin"' in answer.json["error"]
    assert "expected" not in answer.json["error"]
    done = client.post(QUEUE, {"text": "From the page"}, auth="cookie")
    assert done.status == 201, done.json
    assert queued_titles(store) == ["From the page"]


def test_a_script_with_the_bearer_token_needs_no_origin_but_a_foreign_one_is_refused(
        client, store):
    assert client.post(QUEUE, {"text": "Scripted"}).status == 201
    answer = client.post(QUEUE, {"text": "Via a page"}, headers={"Origin": "http://evil.example"})
    assert answer.status == 403
    assert queued_titles(store) == ["Scripted"]


@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded",
                                  "multipart/form-data; boundary=x", None])
def test_an_action_takes_a_json_body_only(client, store, kind):
    # Forms from another site cannot send JSON; text/plain is what they can send.
    headers = {"Content-Type": kind} if kind else {}
    answer = client.request("POST", QUEUE, raw_body=b'{"text": "x"}', headers=headers)
    assert answer.status == 415
    assert "application/json" in answer.json["error"]
    assert queued_titles(store) == []


def test_reading_takes_get_and_acting_post(client):
    assert client.request("PUT", QUEUE, raw_body=b"{}").status == 405
    assert client.request("DELETE", "/api/tasks/abcdef").status == 405
    answer = client.get("/api/tasks/abcdef/cancel")
    assert answer.status == 405 and "takes POST" in answer.json["error"]
    assert client.get("/api/nothing").status == 404


# -- bounds --------------------------------------------------------------------------------------

def raw_exchange(board, data, read=65536):
    with socket.create_connection(("127.0.0.1", board.port), timeout=5) as sock:
        sock.sendall(data)
        chunks = []
        while True:
            try:
                chunk = sock.recv(read)
            except socket.timeout:
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


def post_head(board, length, extra=b""):
    return (b"POST /api/tasks HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer %s\r\n"
            b"Content-Type: application/json\r\n%sContent-Length: %d\r\n\r\n"
            % (board.token.encode(), extra, length))


def test_a_body_over_the_limit_is_refused_unread_and_the_connection_closed(board, store):
    # Only the head is sent: the board answers without waiting for 2 MiB that never come.
    answer = raw_exchange(board, post_head(board, 2 * 1024 * 1024))
    assert answer.startswith(b"HTTP/1.1 413")
    assert b"Connection: close" in answer
    assert b"at most %d are accepted" % ferrus.WEB_BODY_MAX_BYTES in answer
    assert queued_titles(store) == []


def test_a_chunked_or_unmeasured_body_is_refused(board, store):
    chunked = (b"POST /api/tasks HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer %s\r\n"
               b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"5\r\n{\"te\"\r\n0\r\n\r\n" % board.token.encode())
    assert raw_exchange(board, chunked).startswith(b"HTTP/1.1 411")
    assert queued_titles(store) == []


def test_an_overlong_request_line_or_header_is_refused_by_http_server(board):
    line = b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\nHost: localhost\r\n\r\n"
    assert raw_exchange(board, line).startswith(b"HTTP/1.1 414")
    header = b"GET / HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"b" * 70000 + b"\r\n\r\n"
    assert raw_exchange(board, header).startswith(b"HTTP/1.1 431")


def test_event_streams_are_bounded(store):
    with running_board(store, keepalive=0.05) as board:
        board.app.max_streams = 2
        client = BoardClient(board)
        first, second = client.events(), client.events()
        assert first.status == second.status == 200
        third = client.request("GET", "/api/events")
        assert third.status == 503 and "2 event streams are open" in third.json["error"]
        first.close()
        # The board notices the closed stream at its next keep-alive write.
        deadline = time.monotonic() + 10
        while board.app.streams > 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        fourth = client.events()
        assert fourth.status == 200
        second.close()
        fourth.close()


def test_idle_connections_without_the_token_cannot_lock_out_the_board(board):
    idle = [socket.create_connection(("127.0.0.1", board.port), timeout=10)
            for _ in range(ferrus.WEB_UNPROVEN_MAX + 16)]
    try:
        deadline = time.monotonic() + 10
        while board.server.active < ferrus.WEB_UNPROVEN_MAX and time.monotonic() < deadline:
            time.sleep(0.01)
        assert BoardClient(board).get(QUEUE).status == 200
        assert idle[0].recv(100) == b""                 # the oldest idle one was cut
    finally:
        for sock in idle:
            sock.close()


def test_a_connection_that_shows_no_token_in_time_is_closed(board, monkeypatch):
    monkeypatch.setattr(ferrus, "WEB_FIRST_REQUEST_SECS", 0.2)
    with socket.create_connection(("127.0.0.1", board.port), timeout=10) as idle:
        assert idle.recv(100) == b""


def test_connections_past_the_token_are_bounded(board, monkeypatch):
    monkeypatch.setattr(ferrus, "WEB_CONNECTIONS_MAX", 3)
    client = BoardClient(board)
    kept = [http.client.HTTPConnection("127.0.0.1", board.port, timeout=10) for _ in range(3)]
    try:
        for connection in kept:                         # each stays open (keep-alive)
            connection.request("GET", QUEUE, headers=client.auth_headers("bearer", "GET"))
            answer = connection.getresponse()
            answer.read()
            assert answer.status == 200
        refused = client.get(QUEUE)
        assert refused.status == 503 and "serves 3 connections" in refused.json["error"]
        assert client.post(QUEUE, {"text": "Not now"}).status == 503
        assert queued_titles(board.store) == []         # refused before it acted
    finally:
        for connection in kept:
            connection.close()
    deadline = time.monotonic() + 10
    while board.server.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.get(QUEUE).status == 200


# -- what every answer carries ----------------------------------------------------------------

def test_every_answer_is_nosniff_and_no_store(client):
    for answer in (client.get(QUEUE), client.get("/", auth=None), client.get(QUEUE, auth=None),
                   client.get("/api/nothing"), client.get("/", auth="cookie")):
        assert answer.header("X-Content-Type-Options") == "nosniff"
        assert answer.header("Cache-Control") == "no-store"
        assert answer.header("Referrer-Policy") == "no-referrer"
        assert answer.header("X-Frame-Options") == "DENY"
    assert client.get(QUEUE).header("Content-Type") == "application/json; charset=utf-8"


def test_the_page_runs_only_its_own_script_and_style(client):
    first, second = client.get("/", auth="cookie"), client.get("/task/x", auth="cookie")
    policy = first.header("Content-Security-Policy")
    nonce = policy.split("script-src 'nonce-")[1].split("'")[0]
    assert policy == ("default-src 'none'; script-src 'nonce-%s'; style-src 'nonce-%s'; "
                      "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                      "form-action 'none'; frame-ancestors 'none'" % (nonce, nonce))
    assert first.text.count('nonce="%s"' % nonce) == 2        # its <script> and <style>
    assert "<script src" not in first.text and "http://" not in first.text.split("<script")[0]
    assert second.header("Content-Security-Policy") != policy  # a fresh nonce each time
    assert "innerHTML" not in first.text and "insertAdjacentHTML" not in first.text


# -- HTTPS --------------------------------------------------------------------------------------

@pytest.fixture
def certificate(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (needed to make a test certificate)")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    made = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes",
                           "-subj", "/CN=localhost", "-days", "1", "-keyout", str(key),
                           "-out", str(cert)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip("openssl could not make a certificate: %s" % made.stderr[-200:])
    return str(cert), str(key)


def test_with_a_certificate_the_board_speaks_https_and_its_cookie_is_secure(store, certificate):
    import http.client
    with running_board(store, tls_cert=certificate[0], tls_key=certificate[1]) as board:
        assert board.url.startswith("https://127.0.0.1:%d/?token=" % board.port)
        context = ssl.create_default_context(cafile=certificate[0])
        context.check_hostname = False
        connection = http.client.HTTPSConnection("127.0.0.1", board.port, timeout=10,
                                                 context=context)
        connection.request("GET", "/?token=%s" % board.token)
        answer = connection.getresponse()
        answer.read()
        assert answer.status == 303
        assert answer.getheader("Set-Cookie").endswith("; HttpOnly; SameSite=Strict; Secure")
        connection.close()
        # Plain HTTP to it gets no answer, and the board goes on serving.
        plain = raw_exchange(board, b"GET /api/tasks HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert not plain.startswith(b"HTTP/1.1 200")
        connection = http.client.HTTPSConnection("127.0.0.1", board.port, timeout=10,
                                                 context=context)
        connection.request("GET", "/api/tasks", headers={
            "Authorization": "Bearer %s" % board.token})
        assert connection.getresponse().status == 200
        connection.close()


def test_a_certificate_that_does_not_load_is_said_clearly(store, tmp_path):
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate\n")
    with pytest.raises(ferrus.FerrusError) as err:
        ferrus.WebBoard(store, "127.0.0.1", 0, tls_cert=str(bad))
    assert "cannot use the TLS certificate %s" % bad in err.value.message
    assert "--tls-cert CERT.pem --tls-key KEY.pem" in err.value.hint
    with pytest.raises(ferrus.UsageError):
        ferrus.WebBoard(store, "127.0.0.1", 0, tls_key=str(bad))


# -- listening beyond this machine ---------------------------------------------------------------

def test_listening_beyond_loopback_is_warned_about_and_the_tunnel_suggested():
    assert ferrus.web_warnings("127.0.0.1", False) == []
    assert ferrus.web_warnings("localhost", False) == []
    assert ferrus.web_warnings("::1", False) == []
    lines = ferrus.web_warnings("0.0.0.0", False)
    assert "other machines can reach it" in lines[0]
    assert "plain HTTP" in lines[1]
    assert "ssh -L 8765:127.0.0.1:8765" in lines[2]
    assert not any("plain HTTP" in line for line in ferrus.web_warnings("192.0.2.7", True))


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6 on this machine")
def test_the_board_listens_on_ipv6_loopback(store):
    try:
        board = ferrus.WebBoard(store, "::1", 0).start()
    except ferrus.FerrusError as err:
        pytest.skip("cannot listen on ::1 here: %s" % err.message)
    try:
        assert board.url.startswith("http://[::1]:%d/?token=" % board.port)
        import http.client
        connection = http.client.HTTPConnection("::1", board.port, timeout=10)
        connection.request("GET", "/api/tasks", headers={
            "Authorization": "Bearer %s" % board.token})
        assert connection.getresponse().status == 200
        connection.close()
    finally:
        board.close()


def test_the_token_never_reaches_the_log(client, board):
    import logging
    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())
    # The ferrus logger, whatever an earlier in-process main() made of it (setup_logging
    # stops it from propagating to pytest's handlers).
    logger = logging.getLogger("ferrus")
    keep, level = Keep(), logger.level
    logger.setLevel(logging.DEBUG)          # setLevel: it also empties the level cache
    logger.addHandler(keep)
    try:
        assert client.get("/?a=1&token=%s" % board.token, auth=None).status == 303
        assert client.get("/api/tasks").status == 200
    finally:
        logger.removeHandler(keep)
        logger.setLevel(level)
    text = "\n".join(lines)
    assert "web: 127.0.0.1" in text and "token=…" in text
    assert board.token not in text
