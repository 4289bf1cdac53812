"""A standard-library-only PEP 517 / PEP 660 build backend for ferrus.

ferrus is one module without dependencies, so building it needs nothing but the
standard library.  With this in-tree backend (pyproject.toml: ``backend-path``),
``pip install .`` and ``pipx install .`` work offline with any pip that a Python
3.9+ venv ships: nothing has to be downloaded first, not even setuptools (a
Python 3.12+ venv has none).  Metadata comes from pyproject.toml's [project]
table; the version from ``__version__`` in ferrus.py.
"""

import base64
import hashlib
import io
import os
import re
import tarfile
import time
import zipfile

SOURCE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Zip entries and tar members get one fixed time, so two builds are identical.
_EPOCH = int(os.environ.get("SOURCE_DATE_EPOCH", "315532800"))      # 1980-01-01
SDIST_FILES = ("pyproject.toml", "ferrus.py", "ferrus", "README.md", "LICENSE",
               "pep517/ferrus_build.py")


def _read(name):
    with open(os.path.join(SOURCE, name), "r", encoding="utf-8") as handle:
        return handle.read()


def _parse_toml(text):
    try:
        import tomllib
    except ImportError:         # Python < 3.11: ferrus's own reader of the same subset
        import importlib.util
        import sys
        spec = importlib.util.spec_from_file_location(
            "_ferrus_for_build", os.path.join(SOURCE, "ferrus.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module         # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module.parse_toml(text)
    return tomllib.loads(text)


def _project():
    project = dict(_parse_toml(_read("pyproject.toml"))["project"])
    match = re.search(r'^__version__ = "([^"]+)"', _read("ferrus.py"), re.M)
    project["version"] = match.group(1)
    return project


def _dist_name(project):
    return "%s-%s" % (re.sub(r"[-_.]+", "_", project["name"]).lower(), project["version"])


def metadata_text(project):
    """Core metadata (METADATA / PKG-INFO) for the [project] table."""
    lines = ["Metadata-Version: 2.1", "Name: %s" % project["name"],
             "Version: %s" % project["version"]]
    if project.get("description"):
        lines.append("Summary: %s" % project["description"])
    if project.get("license"):
        lines.append("License: %s" % project["license"])
    if project.get("requires-python"):
        lines.append("Requires-Python: %s" % project["requires-python"])
    lines += ["Classifier: %s" % c for c in project.get("classifiers", ())]
    lines += ["Requires-Dist: %s" % d for d in project.get("dependencies", ())]
    for extra, requirements in sorted(project.get("optional-dependencies", {}).items()):
        lines.append("Provides-Extra: %s" % extra)
        lines += ['Requires-Dist: %s; extra == "%s"' % (r, extra) for r in requirements]
    readme = project.get("readme")
    if readme:
        lines.append("Description-Content-Type: text/markdown")
        return "\n".join(lines) + "\n\n" + _read(readme)
    return "\n".join(lines) + "\n"


def _entry_points(project):
    scripts = project.get("scripts", {})
    return "[console_scripts]\n" + "".join("%s = %s\n" % item for item in sorted(scripts.items()))


def _record_line(path, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return "%s,sha256=%s,%d\n" % (path, digest, len(data))


def _write_wheel(directory, files):
    project = _project()
    dist = _dist_name(project)
    info = dist + ".dist-info"
    files = list(files) + [
        (info + "/METADATA", metadata_text(project).encode("utf-8")),
        (info + "/WHEEL", b"Wheel-Version: 1.0\nGenerator: ferrus_build\n"
                          b"Root-Is-Purelib: true\nTag: py3-none-any\n"),
        (info + "/entry_points.txt", _entry_points(project).encode("utf-8")),
    ] + [(info + "/licenses/" + name, _read(name).encode("utf-8"))
         for name in project.get("license-files", ())]
    record = "".join(_record_line(path, data) for path, data in files) + info + "/RECORD,,\n"
    files.append((info + "/RECORD", record.encode("utf-8")))
    name = dist + "-py3-none-any.whl"
    stamp = time.gmtime(max(_EPOCH, 315532800))[:6]
    with zipfile.ZipFile(os.path.join(directory, name), "w", zipfile.ZIP_DEFLATED) as wheel:
        for path, data in files:
            entry = zipfile.ZipInfo(path, stamp)
            entry.external_attr = 0o644 << 16
            entry.compress_type = zipfile.ZIP_DEFLATED
            wheel.writestr(entry, data)
    return name


# -- the PEP 517 and PEP 660 hooks ------------------------------------------------------

def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _write_wheel(wheel_directory, [("ferrus.py", _read("ferrus.py").encode("utf-8"))])


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    # A .pth line puts the source folder on sys.path, so edits to ferrus.py take effect.
    return _write_wheel(wheel_directory, [("ferrus_editable.pth",
                                           (SOURCE + "\n").encode("utf-8"))])


def build_sdist(sdist_directory, config_settings=None):
    project = _project()
    base = _dist_name(project)
    name = base + ".tar.gz"
    members = [(path, _read(path).encode("utf-8")) for path in SDIST_FILES]
    members.append(("PKG-INFO", metadata_text(project).encode("utf-8")))
    with tarfile.open(os.path.join(sdist_directory, name), "w:gz", format=tarfile.PAX_FORMAT) \
            as archive:
        for path, data in members:
            member = tarfile.TarInfo("%s/%s" % (base, path))
            member.size, member.mtime = len(data), _EPOCH
            member.mode = 0o755 if path == "ferrus" else 0o644
            archive.addfile(member, io.BytesIO(data))
    return name
