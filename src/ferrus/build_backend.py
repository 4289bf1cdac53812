"""Packaging: ferrus as its own PEP 517 build backend.

pyproject.toml names ``ferrus:BuildBackend`` (``backend-path = ["."]``), so
``pip install .`` needs nothing but the standard library — no setuptools download,
which is what an air-gapped machine has."""

import os
import re
import time

from .basics import __version__
from .tomlfile import parse_toml


class BuildBackend:
    """The PEP 517 / 660 hooks: a wheel holding ferrus.py, an sdist, an editable wheel.

    Metadata comes from pyproject.toml's [project] table, the version from
    ``__version__``.  Archive members get one fixed time, so two builds are identical."""

    EPOCH = 315532800                                   # 1980-01-01, the zip format's floor
    SDIST_FILES = ("pyproject.toml", "ferrus.py", "ferrus", "README.md", "LICENSE")

    @staticmethod
    def _source():
        return os.path.dirname(os.path.abspath(__file__))

    @classmethod
    def _read(cls, name):
        with open(os.path.join(cls._source(), name), "r", encoding="utf-8") as handle:
            return handle.read()

    @classmethod
    def project(cls):
        project = dict(parse_toml(cls._read("pyproject.toml"))["project"])
        project["version"] = __version__
        return project

    @staticmethod
    def _dist_name(project):
        return "%s-%s" % (re.sub(r"[-_.]+", "_", project["name"]).lower(), project["version"])

    @classmethod
    def metadata_text(cls, project):
        """Core metadata (METADATA in a wheel, PKG-INFO in an sdist)."""
        lines = ["Metadata-Version: 2.1", "Name: %s" % project["name"],
                 "Version: %s" % project["version"]]
        for key, field in (("description", "Summary"), ("license", "License"),
                           ("requires-python", "Requires-Python")):
            if project.get(key):
                lines.append("%s: %s" % (field, project[key]))
        lines += ["Classifier: %s" % c for c in project.get("classifiers", ())]
        lines += ["Requires-Dist: %s" % d for d in project.get("dependencies", ())]
        for extra, requirements in sorted(project.get("optional-dependencies", {}).items()):
            lines.append("Provides-Extra: %s" % extra)
            lines += ['Requires-Dist: %s; extra == "%s"' % (r, extra) for r in requirements]
        if not project.get("readme"):
            return "\n".join(lines) + "\n"
        lines.append("Description-Content-Type: text/markdown")
        return "\n".join(lines) + "\n\n" + cls._read(project["readme"])

    @staticmethod
    def _record_line(path, data):
        import base64
        import hashlib          # build-time only: kept off every command's start-up
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        return "%s,sha256=%s,%d\n" % (path, digest, len(data))

    @classmethod
    def _write_wheel(cls, directory, files):
        import zipfile
        project = cls.project()
        dist = cls._dist_name(project)
        info = dist + ".dist-info"
        scripts = sorted(project.get("scripts", {}).items())
        files = list(files) + [
            (info + "/METADATA", cls.metadata_text(project).encode("utf-8")),
            (info + "/WHEEL", b"Wheel-Version: 1.0\nGenerator: ferrus\n"
                              b"Root-Is-Purelib: true\nTag: py3-none-any\n"),
            (info + "/entry_points.txt",
             ("[console_scripts]\n" + "".join("%s = %s\n" % s for s in scripts)).encode()),
        ] + [(info + "/licenses/" + name, cls._read(name).encode("utf-8"))
             for name in project.get("license-files", ())]
        record = "".join(cls._record_line(path, data) for path, data in files)
        files.append((info + "/RECORD", (record + info + "/RECORD,,\n").encode("utf-8")))
        name = dist + "-py3-none-any.whl"
        with zipfile.ZipFile(os.path.join(directory, name), "w", zipfile.ZIP_DEFLATED) as wheel:
            for path, data in files:
                entry = zipfile.ZipInfo(path, time.gmtime(cls._epoch())[:6])
                entry.external_attr = 0o644 << 16
                entry.compress_type = zipfile.ZIP_DEFLATED
                wheel.writestr(entry, data)
        return name

    @classmethod
    def _epoch(cls):
        return max(cls.EPOCH, int(os.environ.get("SOURCE_DATE_EPOCH", cls.EPOCH)))

    # -- the hooks pip calls ---------------------------------------------------------

    @staticmethod
    def get_requires_for_build_wheel(config_settings=None):
        return []

    get_requires_for_build_sdist = get_requires_for_build_editable = get_requires_for_build_wheel

    @classmethod
    def build_wheel(cls, wheel_directory, config_settings=None, metadata_directory=None):
        return cls._write_wheel(wheel_directory,
                                [("ferrus.py", cls._read("ferrus.py").encode("utf-8"))])

    @classmethod
    def build_editable(cls, wheel_directory, config_settings=None, metadata_directory=None):
        # A .pth line puts the source folder on sys.path, so edits take effect at once.
        return cls._write_wheel(wheel_directory, [("ferrus_editable.pth",
                                                   (cls._source() + "\n").encode("utf-8"))])

    @classmethod
    def _sdist_paths(cls):
        """The fixed files, then docs/*.md when the folder is there (README links to them;
        a copy of the five files alone still builds)."""
        docs = os.path.join(cls._source(), "docs")
        found = sorted(name for name in os.listdir(docs) if name.endswith(".md")) \
            if os.path.isdir(docs) else []
        return list(cls.SDIST_FILES) + ["docs/" + name for name in found]

    @classmethod
    def build_sdist(cls, sdist_directory, config_settings=None):
        import io
        import tarfile
        project = cls.project()
        base = cls._dist_name(project)
        members = [(path, cls._read(path).encode("utf-8")) for path in cls._sdist_paths()]
        members.append(("PKG-INFO", cls.metadata_text(project).encode("utf-8")))
        name = base + ".tar.gz"
        with tarfile.open(os.path.join(sdist_directory, name), "w:gz",
                          format=tarfile.PAX_FORMAT) as archive:
            for path, data in members:
                member = tarfile.TarInfo("%s/%s" % (base, path))
                member.size, member.mtime = len(data), cls._epoch()
                member.mode = 0o755 if path == "ferrus" else 0o644
                archive.addfile(member, io.BytesIO(data))
        return name
