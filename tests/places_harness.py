"""A "remote machine" for the tests of places: a second local user, reached through a real
sshd on 127.0.0.1 and through `runuser -u USER --`, so no path is shared with the tests.

Everything here needs root (to add the user and to run sshd); where that, sshd, useradd
or runuser is missing, the fixtures skip and say why.  .ci/run installs openssh-server
(and bubblewrap) where the package manager allows.

    ssh_place(tmp_path)   a PlaceConfig reaching the user over ssh (session-wide sshd)
    exec_place(tmp_path)  a PlaceConfig reaching the user through runuser
    local_place(tmp_path) a PlaceConfig running at this machine as this user (`env`):
                          the channel's logic without sshd, fast, available everywhere
    place_home()          the remote user's home folder (to look at what a place holds)
    as_place_user(argv)   runs argv as the remote user (to look, or to clean up)

Each PlaceConfig gets a `dir` of its own under the user's home (removed afterwards), so
tests never see each other's projects or copies of ferrus.
"""

import contextlib
import json
import os
import pwd
import signal
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

import ferrus

PLACE_USER = "ferrusplace"
SSHD = shutil.which("sshd") or ("/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None)
# The remote user's Python: runuser keeps the caller's PATH (whose python3 may be in a
# folder only root can read), so the place names its interpreter.
PLACE_PYTHON = "/usr/bin/python3"


def _skip_reason():
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "the places harness adds a local user and runs sshd: it needs root"
    for tool in ("useradd", "runuser", "ssh", "ssh-keygen", "git"):
        if not shutil.which(tool):
            return "%s is not installed (apt-get install -y openssh-server)" % tool
    if not SSHD:
        return "sshd is not installed (apt-get install -y openssh-server)"
    if not os.path.exists(PLACE_PYTHON):
        return "%s is missing (the remote user's Python)" % PLACE_PYTHON
    return None


def require_place_user():
    """The remote user (made once, kept: useradd is slow and the user holds nothing)."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    try:
        pwd.getpwnam(PLACE_USER)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", PLACE_USER],
                       check=True, capture_output=True)
    # "*": no password, but not locked (sshd without PAM refuses locked accounts).
    subprocess.run(["usermod", "-p", "*", PLACE_USER], check=True, capture_output=True)
    return PLACE_USER


def place_home():
    return pwd.getpwnam(PLACE_USER).pw_dir


def as_place_user(argv, **kwargs):
    return subprocess.run(["runuser", "-u", PLACE_USER, "--"] + list(argv),
                          capture_output=True, **kwargs)


def _free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class SshServer:
    """sshd on 127.0.0.1 letting the test key in as the remote user, and nobody else."""

    def __init__(self):
        # Outside /tmp's private test folders: sshd reads authorized_keys as the user.
        self.folder = tempfile.mkdtemp(prefix="ferrus-sshd-", dir="/var/tmp")
        os.chmod(self.folder, 0o755)
        self.port = _free_port()
        self.host_key = os.path.join(self.folder, "host_ed25519")
        self.client_key = os.path.join(self.folder, "client_ed25519")
        for key in (self.host_key, self.client_key):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key],
                           check=True, capture_output=True)
        authorized = os.path.join(self.folder, "authorized_keys")
        shutil.copy(self.client_key + ".pub", authorized)
        os.chmod(authorized, 0o644)
        self.known_hosts = os.path.join(self.folder, "known_hosts")
        with open(self.host_key + ".pub") as handle:
            host_public = " ".join(handle.read().split()[:2])
        with open(self.known_hosts, "w") as handle:
            handle.write("[127.0.0.1]:%d %s\n" % (self.port, host_public))
        self.config = os.path.join(self.folder, "sshd_config")
        with open(self.config, "w") as handle:
            handle.write("\n".join([
                "Port %d" % self.port, "ListenAddress 127.0.0.1",
                "HostKey %s" % self.host_key, "PidFile %s" % os.path.join(self.folder, "pid"),
                "AuthorizedKeysFile %s" % authorized, "StrictModes no", "UsePAM no",
                "PasswordAuthentication no", "KbdInteractiveAuthentication no",
                "PubkeyAuthentication yes", "AllowUsers %s" % PLACE_USER,
                "PermitRootLogin no", "MaxStartups 100", "MaxSessions 100",
                "LogLevel ERROR", ""]))
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)     # its privilege separation
        self.log = open(os.path.join(self.folder, "sshd.log"), "wb")
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", self.config],
                                     stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.02)
        self.stop()
        pytest.skip("sshd did not start: %s" % open(self.log.name).read()[-300:])

    def prefix(self):
        """The ssh argv prefix of a place reaching the remote user (no user config read)."""
        return ["ssh", "-F", "/dev/null", "-i", self.client_key, "-o", "IdentitiesOnly=yes",
                "-o", "IdentityAgent=none", "-o", "UserKnownHostsFile=" + self.known_hosts,
                "-o", "StrictHostKeyChecking=yes", "-o", "LogLevel=ERROR",
                "-p", str(self.port), "%s@127.0.0.1" % PLACE_USER]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.log.close()
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture(scope="session")
def sshd():
    require_place_user()
    server = SshServer()
    yield server
    server.stop()


def _place_dir(tmp_path):
    return "~/.ferrus-places/%s-%d" % (tmp_path.name[-40:], os.getpid())


@pytest.fixture
def ssh_place(sshd, tmp_path):
    config = ferrus.PlaceConfig("box", ssh=sshd.prefix(), dir=_place_dir(tmp_path),
                                python=PLACE_PYTHON)
    yield config
    _remove_place_dir(config)


@pytest.fixture
def exec_place(tmp_path):
    require_place_user()
    config = ferrus.PlaceConfig("pod", exec=["runuser", "-u", PLACE_USER, "--"],
                                dir=_place_dir(tmp_path), python=PLACE_PYTHON)
    yield config
    _remove_place_dir(config)


@pytest.fixture
def local_place(tmp_path):
    """This machine, this user, through `env` (an exec prefix that changes nothing)."""
    config = ferrus.PlaceConfig("local", exec=["env"], dir=str(tmp_path / "place"),
                                python=sys.executable)
    return config


def _remove_place_dir(config):
    folder = os.path.join(place_home(), config.dir[2:])
    end_jobs(folder)
    shutil.rmtree(folder, ignore_errors=True)


def end_jobs(folder):
    """End the jobs a failed test left running under a place's folder, by the process ids
    their job.json records (their supervisor, and the process group of their task)."""
    for where, _, files in os.walk(folder):
        if "job.json" not in files:
            continue
        try:
            with open(os.path.join(where, "job.json")) as handle:
                job = json.load(handle)
        except (OSError, ValueError):
            continue
        if job.get("state") != "running":
            continue
        for pid, group in ((job.get("child"), True), (job.get("pid"), False)):
            if isinstance(pid, int) and pid > 1:
                with contextlib.suppress(OSError):
                    (os.killpg if group else os.kill)(pid, signal.SIGKILL)
