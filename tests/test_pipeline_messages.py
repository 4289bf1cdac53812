"""What a pipeline tells its human: a summary of the outputs at pause_after, and the
delivered path where the file really is once the run is archived."""

import copy
import os

import ferrus
from test_pipelines import RESEARCH, configure, drive, spawn_log  # noqa: F401  (fixture)


def test_pause_after_summarises_the_outputs(project, store, spawn_log):  # noqa: F811
    workflows = copy.deepcopy(RESEARCH)
    workflows["research"]["phases"][0]["pause_after"] = True
    configure(project, workflows=workflows)
    messages = []
    orchestrator = ferrus.PipelineOrchestrator(store, emit=messages.append)
    run = orchestrator.create("research", "pausing")
    assert drive(lambda: orchestrator, run).state == "paused"
    paused = [m.text for m in messages if "is done; its outputs" in m.text]
    assert len(paused) == 1
    text = paused[0]
    for role in ("researcher-a", "researcher-b"):
        output = os.path.join(store.root, ".ferrus", "pipelines", run, role + ".md")
        first = next(line.strip() for line in open(output) if line.strip())
        assert ".ferrus/pipelines/%s/%s.md (" % (run, role) in text
        assert first[:90] in text
    assert "words)" in text and "ferrus pipeline continue %s" % run in text


def test_summary_of_a_huge_or_strange_output_stays_short(tmp_path):
    path = tmp_path / "big.md"
    path.write_text("\x1b[31mred\x07 title\n" + ("word " * 50 + "\n") * 5000)
    lines = ferrus.summarize_output(str(path), "big.md")
    assert lines[0].startswith("  - big.md (") and "bytes" in lines[0]
    assert "\x1b" not in "".join(lines) and "?[31mred? title" in lines[1]
    assert len(lines) <= 5 and all(len(line) < 120 for line in lines)
    assert "unreadable" in ferrus.summarize_output(str(tmp_path / "missing.md"), "m")[0]


def test_the_delivered_path_exists_after_archiving(project, store, spawn_log):  # noqa: F811
    configure(project)
    messages = []
    orchestrator = ferrus.PipelineOrchestrator(store, emit=messages.append)
    run = orchestrator.create("research", "deliver")
    outcome = drive(lambda: orchestrator, run)
    assert outcome.state == "delivered"
    delivered = [m.text for m in messages if m.text.startswith("delivered ")]
    assert len(delivered) == 1
    path = delivered[0][len("delivered "):]
    assert os.path.isfile(os.path.join(store.root, path)), path
    assert "/archive/" in path and os.path.isfile(outcome.output)
