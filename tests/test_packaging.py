"""`pip install .` works offline: the in-tree, standard-library-only build backend."""

import base64
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

import ferrus
from conftest import REPO


def backend():
    return ferrus.BuildBackend


def test_the_wheel_holds_ferrus_its_metadata_and_its_command(tmp_path):
    name = backend().build_wheel(str(tmp_path))
    assert name == "ferrus-%s-py3-none-any.whl" % ferrus.__version__
    with zipfile.ZipFile(str(tmp_path / name)) as wheel:
        names = wheel.namelist()
        info = "ferrus-%s.dist-info/" % ferrus.__version__
        assert "ferrus.py" in names and info + "licenses/LICENSE" in names
        with open(os.path.join(REPO, "ferrus.py"), "rb") as handle:
            assert wheel.read("ferrus.py") == handle.read().replace(b"\r\n", b"\n")
        metadata = wheel.read(info + "METADATA").decode()
        assert "Version: %s\n" % ferrus.__version__ in metadata
        assert "Requires-Python: >=3.9" in metadata and "# ferrus" in metadata
        assert 'Requires-Dist: pytest; extra == "test"' in metadata
        assert "ferrus = ferrus:main" in wheel.read(info + "entry_points.txt").decode()
        for line in wheel.read(info + "RECORD").decode().splitlines():
            path, digest, size = line.split(",")
            if path == info + "RECORD":
                continue
            data = wheel.read(path)
            expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            assert digest == "sha256=" + expected.decode() and int(size) == len(data)


def test_the_sdist_can_be_built_again(tmp_path):
    name = backend().build_sdist(str(tmp_path))
    with tarfile.open(str(tmp_path / name)) as archive:
        members = archive.getnames()
    base = name[:-len(".tar.gz")]
    for path in ("pyproject.toml", "ferrus.py", "ferrus", "README.md", "LICENSE", "PKG-INFO"):
        assert "%s/%s" % (base, path) in members
    # README links into docs/, so the sdist carries every page of it.
    for page in sorted(os.listdir(os.path.join(REPO, "docs"))):
        if page.endswith(".md"):
            assert "%s/docs/%s" % (base, page) in members


def test_pip_install_works_offline_in_a_fresh_venv(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    for name in ("ferrus.py", "ferrus", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(os.path.join(REPO, name), str(source / name))
    venv = tmp_path / "venv"
    made = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True,
                          text=True, timeout=300)
    if made.returncode != 0:
        pytest.skip("cannot create a venv with pip here: %s" % made.stderr.strip()[-200:])
    bindir = venv / ("Scripts" if os.name == "nt" else "bin")
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PYTHONPATH", None)
    installed = subprocess.run([str(bindir / "python"), "-m", "pip", "install", str(source)],
                               capture_output=True, text=True, env=env, timeout=300)
    assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-2000:]
    version = subprocess.run([str(bindir / "ferrus"), "--version"], capture_output=True,
                             text=True, env=env, timeout=60)
    assert version.stdout.strip() == "ferrus %s" % ferrus.__version__
