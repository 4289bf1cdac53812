"""Specs: milestones — parsing, selection, dependencies, completion.

Spec files and their milestones — parsing, selection, dependencies, completion."""

import os
import re

from .basics import FerrusError, LazyPattern, deferred_dataclass
from .system import read_text


@deferred_dataclass
class Milestone:
    """One `- [ ]` milestone of a spec, with what it depends on."""

    marker: str
    id: str
    title: str
    depends_on: list
    completed: bool
    line_index: int

    def display(self):
        return "%s %s" % (self.marker, self.title)


_MILESTONE_RE = LazyPattern(r"^\s*- \[([ xX])\] (.*)$")
_FENCE_RE = LazyPattern(r"^\s*(```|~~~)")
_HEADING_RE = LazyPattern(r"^#{1,6}\s")


def _milestone_header(line):
    match = _MILESTONE_RE.match(line.rstrip("\r\n"))
    if not match:
        return None
    rest = match.group(2).strip()
    if not rest.startswith("#"):
        return None
    parts = rest.split(None, 1)
    if len(parts) < 2 or len(parts[0]) < 2 or not parts[1].strip():
        return None
    return match.group(1) in "xX", parts[0], parts[1].strip()


def parse_spec(text):
    """The milestones of a spec: upstream's rules, with their edge cases fixed (see
    ARCHITECTURE.md, 'Differences from upstream ferrus', item 15).

    A milestone's own lines end at the next milestone, at a Markdown heading or
    at the end of its list; fenced code blocks are never read; the first ``ID:``
    wins; ``Depends on:`` is parsed into markers and ids."""
    milestones = []
    current = None
    in_fence = False
    for index, line in enumerate(text.split("\n")):
        if _FENCE_RE.match(line):
            in_fence = not in_fence
            current = None
            continue
        if in_fence:
            continue
        header = _milestone_header(line)
        if header:
            completed, marker, title = header
            current = Milestone(marker, "", title, [], completed, index)
            milestones.append(current)
            continue
        if current is None:
            continue
        stripped = line.strip()
        if _HEADING_RE.match(line):
            current = None
            continue
        if stripped.startswith("- "):
            stripped = stripped[2:].strip()
        if stripped.startswith("ID:") and not current.id:
            current.id = stripped[3:].strip()
        elif stripped.startswith("Depends on:"):
            value = stripped[len("Depends on:"):].strip()
            current.depends_on = [] if value.lower() in ("", "none") else [
                part.strip() for part in value.split(",") if part.strip()]
    return [m for m in milestones if m.id]


def dependencies_met(milestone, milestones):
    done = {m.marker for m in milestones if m.completed} | {m.id for m in milestones if m.completed}
    known = {m.marker for m in milestones} | {m.id for m in milestones}
    return all(dep in done for dep in milestone.depends_on if dep in known)


def first_ready_milestone(milestones, after=None):
    """The first incomplete milestone whose dependencies are complete (after ``after``)."""
    started = after is None
    for milestone in milestones:
        if not started:
            started = milestone.id == after
            continue
        if not milestone.completed and dependencies_met(milestone, milestones):
            return milestone
    return None


def next_ready_milestone(milestones, after):
    """The milestone to select once ``after`` is done: the next ready one in document
    order, else an earlier one that was waiting on it (``Depends on:`` may point forward)."""
    return first_ready_milestone(milestones, after=after) or first_ready_milestone(milestones)


def unmet_dependencies(milestone, milestones):
    """The markers or ids ``milestone`` waits for that are not complete yet."""
    done = {m.marker for m in milestones if m.completed} | {m.id for m in milestones if m.completed}
    known = {m.marker for m in milestones} | {m.id for m in milestones}
    return [dep for dep in milestone.depends_on if dep in known and dep not in done]


def milestone_block(text, milestone):
    """The milestone's header line and its own child lines, as written in the spec."""
    lines = text.split("\n")
    block = [lines[milestone.line_index].strip()]
    for line in lines[milestone.line_index + 1:]:
        if _milestone_header(line) or _HEADING_RE.match(line) or _FENCE_RE.match(line):
            break
        block.append(line.rstrip())
    while block and not block[-1].strip():
        block.pop()
    return "\n".join(block)


def milestone_task_text(spec_path, text, milestone):
    """A task description for ``ferrus run --milestone``: the milestone and its spec."""
    return ("Implement milestone %s (ID %s) of the spec %s.\n\n%s\n\n"
            "Read the whole spec for context. Do this milestone only; the reviewer checks "
            "it against the spec's requirements and acceptance criteria.\n"
            % (milestone.marker, milestone.id, spec_path, milestone_block(text, milestone)))


def spec_directory(root, config):
    directory = config.spec.directory.strip()
    if not directory:
        raise FerrusError("ferrus.toml [spec].directory is empty.",
                          "set it to a folder such as \"docs/specs\"")
    return os.path.join(root, directory)


def list_spec_paths(root, config):
    directory = spec_directory(root, config)
    if not os.path.isdir(directory):
        return []
    rel = os.path.relpath(directory, root).replace(os.sep, "/")
    return sorted("%s/%s" % (rel, name) for name in os.listdir(directory)
                  if name.endswith(".md") and os.path.isfile(os.path.join(directory, name)))


def spec_display_name(path):
    stem = os.path.splitext(os.path.basename(path))[0]
    if len(stem) > 11 and re.match(r"^\d{4}-\d{2}-\d{2}-", stem):
        stem = stem[11:]
    return stem


def resolve_selected(root, data):
    """(spec_path, milestone) for the selection, or raise FerrusError saying what is missing."""
    if not data.selected_spec or not data.selected_milestone:
        raise FerrusError("no spec milestone is selected",
                          "select one in HQ with /milestones, or create a spec first")
    path = os.path.join(root, data.selected_spec)
    if not os.path.isfile(path):
        raise FerrusError("the selected spec %s does not exist" % data.selected_spec,
                          "select another spec with /milestones")
    for milestone in parse_spec(read_text(path)):
        if milestone.id == data.selected_milestone:
            return data.selected_spec, milestone
    raise FerrusError("milestone %s is not in %s" % (data.selected_milestone, data.selected_spec),
                      "select another milestone with /milestones")


# Longest slug in a spec's file name: with the date, a "-NNNN" counter, ".md" and
# atomic_write's temporary-name decoration it stays far below the 255-byte limit
# of common file systems (a 239-character title used to fail "File name too long").
SLUG_MAX_CHARS = 80


def slugify(title, max_chars=SLUG_MAX_CHARS):
    slug = re.sub(r"[^a-z0-9]+", "-", title.lower().encode("ascii", "replace").decode("ascii")
                  .replace("?", "-")).strip("-")
    if len(slug) > max_chars:
        # Cut at a word boundary when one is near, so the name stays readable.
        cut = slug[:max_chars + 1].rfind("-")
        slug = (slug[:cut] if cut >= max_chars // 2 else slug[:max_chars]).strip("-")
    return slug or "spec"


def spec_title(markdown):
    for line in markdown.split("\n"):
        stripped = line.strip()
        if stripped.startswith("# ") and stripped[2:].strip():
            return stripped[2:].strip()
    return "spec"


def mark_milestone_complete(text, milestone):
    """The spec text with that milestone's box ticked; every other byte unchanged."""
    lines = text.split("\n")
    line = lines[milestone.line_index]
    lines[milestone.line_index] = line.replace("- [ ]", "- [x]", 1)
    return "\n".join(lines)


SPEC_TEMPLATE = """# <Feature Name> Specification

## Summary
One paragraph: what this feature is and who it is for.

## Goals
- What must be true when this is done.

## Non-Goals
- What is deliberately left out.

## Context
Where this fits in the codebase, and anything a newcomer must know first.

## Requirements
- Behaviour, interfaces, error handling, performance.

## Milestones
Order milestones so that each one can be built, checked and reviewed on its own.
Each milestone is a checkbox line with a marker such as `#1.0`, followed by an
`ID:` line and a `Depends on:` line (`none`, or markers like `#1.0, #1.1`).
ferrus picks the first unchecked milestone whose dependencies are checked.

- [ ] #1.0 ...
  - ID: m1.0
  - Depends on: none
- [ ] #1.1 ...
  - ID: m1.1
  - Depends on: #1.0
- [ ] #1.2 ...
  - ID: m1.2
  - Depends on: #1.0

## Acceptance Criteria
- How a reviewer decides that the feature is done.

## Risks and Open Questions
- What could go wrong, and what is still undecided.
"""
