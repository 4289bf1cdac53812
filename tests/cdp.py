"""A headless Chromium driven through the DevTools protocol, standard library only.

Chromium is started with --remote-debugging-port=0 and its own profile folder; the port
it chose is read from DevToolsActivePort there; the page's WebSocket (RFC 6455, client
side: masked frames out, text frames in, ping answered) carries the protocol's JSON
messages.  A reader thread files answers by id and keeps events; JavaScript dialogs
(confirm()) are accepted as they open, as a user would click OK.

    with Chromium() as browser:
        page = browser.page()
        page.navigate("http://127.0.0.1:8765/?token=…")
        page.wait_for("document.querySelector('.card') !== null")

Used by tests/test_web_browser.py and bench/web.py; find_chromium() is None when no
Chromium is installed (the tests then skip and say so).
"""

import base64
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium():
    """The path of a Chromium (or Chrome) binary, or None; $FERRUS_CHROMIUM wins."""
    chosen = os.environ.get("FERRUS_CHROMIUM")
    if chosen:
        return chosen if os.path.isfile(chosen) else None
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


class CdpError(Exception):
    pass


class WebSocket:
    """The client end of one WebSocket connection (no extensions, no TLS)."""

    def __init__(self, url, timeout=10.0):
        parts = urllib.parse.urlsplit(url)
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        request = ("GET %s HTTP/1.1\r\nHost: %s:%d\r\nUpgrade: websocket\r\n"
                   "Connection: Upgrade\r\nSec-WebSocket-Key: %s\r\n"
                   "Sec-WebSocket-Version: 13\r\n\r\n" % (
                       parts.path + ("?" + parts.query if parts.query else ""),
                       parts.hostname, parts.port, key))
        self.sock.sendall(request.encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise CdpError("the DevTools socket closed during the handshake")
            head += chunk
        head, _, self.buffer = head.partition(b"\r\n\r\n")
        if b" 101 " not in head.split(b"\r\n", 1)[0]:
            raise CdpError("no WebSocket upgrade: %r" % head[:200])
        self.sock.settimeout(None)
        self.send_lock = threading.Lock()

    def send(self, text, opcode=1):
        payload = text.encode() if isinstance(text, str) else text
        header = bytes([0x80 | opcode])
        length = len(payload)
        if length < 126:
            header += bytes([0x80 | length])
        elif length < 1 << 16:
            header += bytes([0x80 | 126]) + struct.pack("!H", length)
        else:
            header += bytes([0x80 | 127]) + struct.pack("!Q", length)
        mask = os.urandom(4)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        with self.send_lock:
            self.sock.sendall(header + mask + masked)

    def _read(self, count):
        while len(self.buffer) < count:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise EOFError("the DevTools socket closed")
            self.buffer += chunk
        data, self.buffer = self.buffer[:count], self.buffer[count:]
        return data

    def receive(self):
        """The next whole text message (None when the other end closes)."""
        message = b""
        while True:
            first, second = self._read(2)
            opcode, length = first & 0x0F, second & 0x7F
            if length == 126:
                length = struct.unpack("!H", self._read(2))[0]
            elif length == 127:
                length = struct.unpack("!Q", self._read(8))[0]
            mask = self._read(4) if second & 0x80 else None
            payload = self._read(length)
            if mask:
                payload = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
            if opcode == 8:
                return None
            if opcode == 9:
                self.send(payload, opcode=10)
                continue
            if opcode in (0, 1, 2):
                message += payload
                if first & 0x80:
                    return message.decode("utf-8", "replace")

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass


class Page:
    """One page target: send(method, params) -> its result; events as they came."""

    def __init__(self, url):
        self.ws = WebSocket(url)
        self.next_id = 0
        self.results = {}
        self.events = []
        self.changed = threading.Condition()
        self.dialogs = []
        self.closed = False
        threading.Thread(target=self._reader, daemon=True).start()
        self.send("Page.enable")
        self.send("Runtime.enable")

    def _reader(self):
        try:
            while True:
                text = self.ws.receive()
                if text is None:
                    break
                message = json.loads(text)
                if message.get("method") == "Page.javascriptDialogOpening":
                    self.dialogs.append(message["params"].get("message"))
                    self._post("Page.handleJavaScriptDialog", {"accept": True})
                with self.changed:
                    if "id" in message:
                        self.results[message["id"]] = message
                    else:
                        self.events.append(message)
                    self.changed.notify_all()
        except (OSError, EOFError, ValueError):
            pass
        with self.changed:
            self.closed = True
            self.changed.notify_all()

    def _post(self, method, params=None):
        with self.changed:
            self.next_id += 1
            number = self.next_id
        self.ws.send(json.dumps({"id": number, "method": method, "params": params or {}}))
        return number

    def send(self, method, params=None, timeout=30.0):
        number = self._post(method, params)
        deadline = time.monotonic() + timeout
        with self.changed:
            while number not in self.results:
                if self.closed:
                    raise CdpError("the browser went away during %s" % method)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CdpError("no answer to %s in %.0f s" % (method, timeout))
                self.changed.wait(left)
            answer = self.results.pop(number)
        if "error" in answer:
            raise CdpError("%s: %s" % (method, answer["error"]))
        return answer.get("result", {})

    def evaluate(self, expression, timeout=30.0):
        """The value of a JavaScript expression (awaited when it is a promise)."""
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True}, timeout=timeout)
        if result.get("exceptionDetails"):
            raise CdpError("JavaScript failed: %s" % json.dumps(result["exceptionDetails"])[:500])
        return result.get("result", {}).get("value")

    def navigate(self, url, timeout=30.0):
        self.send("Page.navigate", {"url": url})
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'",
                      timeout=timeout)

    def wait_for(self, expression, timeout=30.0, interval=0.05):
        """Evaluate ``expression`` until it is truthy (the test side polls; the page
        itself only reacts to what the server pushes)."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() >= deadline:
                raise CdpError("timed out after %.0f s waiting for %s" % (timeout, expression))
            time.sleep(interval)

    def screenshot(self, path):
        data = self.send("Page.captureScreenshot", {"format": "png",
                                                    "captureBeyondViewport": False})["data"]
        with open(path, "wb") as handle:
            handle.write(base64.b64decode(data))

    def close(self):
        self.ws.close()


class Chromium:
    """A headless Chromium with a profile of its own, stopped (and its folder removed)
    on close()."""

    def __init__(self, binary=None, width=1280, height=900, timeout=30.0):
        self.binary = binary or find_chromium()
        if not self.binary:
            raise CdpError("no Chromium found (install Debian's chromium, or set "
                           "FERRUS_CHROMIUM)")
        self.profile = tempfile.mkdtemp(prefix="ferrus-chromium-")
        argv = [self.binary, "--headless=new", "--disable-gpu", "--no-first-run",
                "--no-default-browser-check", "--disable-extensions",
                "--disable-background-networking", "--disable-sync", "--mute-audio",
                "--remote-debugging-port=0", "--remote-allow-origins=*",
                "--user-data-dir=%s" % self.profile, "--window-size=%d,%d" % (width, height),
                "about:blank"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            argv.insert(1, "--no-sandbox")       # Chromium refuses to run as root otherwise
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        self.port = self._port(timeout)
        self.pages = []

    def _port(self, timeout):
        path = os.path.join(self.profile, "DevToolsActivePort")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise CdpError("Chromium exited (%s) before it listened" % self.proc.returncode)
            try:
                with open(path) as handle:
                    lines = handle.read().split()
                if lines:
                    return int(lines[0])
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        raise CdpError("Chromium did not open its DevTools port in %.0f s" % timeout)

    def page(self):
        """A new tab."""
        request = urllib.request.Request("http://127.0.0.1:%d/json/new?about:blank" % self.port,
                                         method="PUT")
        with urllib.request.urlopen(request, timeout=10) as answer:
            target = json.loads(answer.read())
        page = Page(target["webSocketDebuggerUrl"])
        self.pages.append(page)
        return page

    def close(self):
        for page in self.pages:
            page.close()
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.proc.wait(10)
        shutil.rmtree(self.profile, ignore_errors=True)

    def _signal_group(self, number):
        # Chromium's helper processes share the group it was started in (its own).
        try:
            os.killpg(self.proc.pid, number)
        except (ProcessLookupError, PermissionError, AttributeError):
            self.proc.kill() if number != signal.SIGTERM else self.proc.terminate()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
