#!/usr/bin/env python3
"""Repository graph benchmark: `ferrus graph index` of 2,000 generated files (full, then
after one file changed), and search latency with 100,000 definitions indexed.

    python bench/graph.py [--quick] [--json] [--files N] [--ferrus PATH] [--keep]

Prints one table: each figure, what was measured, the bar beside it and PASS / MISS.
The projects are generated in a temporary folder as git repositories in eight languages
(Python, TypeScript, JavaScript, Go, Rust, Java, C, C++), every file defining, importing
and calling names of others.  Everything is measured in-process through the operations
the CLI and the MCP tools call (graph_index, graph_open + graph_search, op_graph_search),
so the interpreter's start-up is not part of it; an info row gives `ferrus graph index`
typed in a shell.  Standard library only.
"""

import argparse
import importlib.util
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DEFAULT_FERRUS = os.path.join(REPO, "ferrus.py")

FULL_BAR = 2.0
INCREMENTAL_BAR = 0.2
SEARCH_BAR = 0.05
EXTENSIONS = ("py", "ts", "js", "go", "rs", "java", "c", "cpp")


def load(ferrus_path):
    """(ferrus, the module with the graph or None), ferrus imported as the module
    ``ferrus`` (as bench/run.py does)."""
    spec = importlib.util.spec_from_file_location("ferrus", ferrus_path)
    ferrus = importlib.util.module_from_spec(spec)
    sys.modules["ferrus"] = ferrus
    spec.loader.exec_module(ferrus)
    return ferrus, graph_module(ferrus, ferrus_path)


def graph_module(ferrus, ferrus_path):
    """ferrus itself when it carries the repository graph, else None (an older
    ferrus.py given with --ferrus)."""
    return ferrus if hasattr(ferrus, "graph_index") else None


# -- generated projects -------------------------------------------------------------------------

def source(ext, index, count, defs):
    """The text of generated file ``index`` (of ``count``) with ``defs`` definitions."""
    other = (index * 7 + 3) % count
    names = ["item%d_%d" % (index, k) for k in range(defs)]
    called = "item%d_0" % other
    if ext == "py":
        lines = ["import os", "from mod%d import %s" % (other, called), ""]
        lines += ["class Thing%d:" % index, "    def method%d(self, x):" % index,
                  "        return %s(x)" % called, ""]
        for name in names:
            lines += ["def %s(value):" % name, "    total = os.path.join(str(value), 'x')",
                      "    return %s(total)" % called, ""]
    elif ext in ("ts", "js"):
        lines = ['import { %s } from "./mod%d";' % (called, other), ""]
        lines += ["export class Thing%d {" % index, "  method%d(x) {" % index,
                  "    return %s(x);" % called, "  }", "}", ""]
        for name in names:
            lines += ["export function %s(value) {" % name,
                      "  const total = String(value) + 'x';", "  return %s(total);" % called,
                      "}", ""]
    elif ext == "go":
        lines = ["package mod", "", 'import "fmt"', "",
                 "type Thing%d struct {" % index, "\tname string", "}", "",
                 "func (t *Thing%d) Method%d(x int) int {" % (index, index),
                 "\treturn %s(x)" % called, "}", ""]
        for name in names:
            lines += ["func %s(value int) int {" % name, '\tfmt.Println("x")',
                      "\treturn %s(value)" % called, "}", ""]
    elif ext == "rs":
        lines = ["use crate::mod%d::%s;" % (other, called), "",
                 "pub struct Thing%d { name: String }" % index, "",
                 "impl Thing%d {" % index, "    pub fn method%d(&self, x: i64) -> i64 {" % index,
                 "        %s(x)" % called, "    }", "}", ""]
        for name in names:
            lines += ["pub fn %s(value: i64) -> i64 {" % name,
                      '    let total = format!("{}x", value);', "    %s(value)" % called,
                      "}", ""]
    elif ext == "java":
        lines = ["package bench.gen;", "", "import bench.gen.Mod%d;" % other, "",
                 "public class Mod%d {" % index]
        for name in names:
            lines += ["    public static int %s(int value) {" % name,
                      '        String total = String.valueOf(value) + "x";',
                      "        return %s(value);" % called, "    }", ""]
        lines += ["}", ""]
    else:
        lines = ['#include "mod%d.h"' % other, "#include <stdio.h>", ""]
        for name in names:
            lines += ["int %s(int value)" % name, "{", '    printf("x");',
                      "    return %s(value);" % called, "}", ""]
    return "\n".join(lines) + "\n"


def generate(root, files, defs):
    """A git repository of ``files`` generated files (``defs`` definitions each), all
    committed, and `ferrus init` run in it."""
    os.makedirs(root)
    for index in range(files):
        ext = EXTENSIONS[index % len(EXTENSIONS)]
        folder = os.path.join(root, "src", "pkg%d" % (index % 40))
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "mod%d.%s" % (index, ext)), "w") as handle:
            handle.write(source(ext, index, files, defs))
    env = dict(os.environ, GIT_AUTHOR_NAME="bench", GIT_AUTHOR_EMAIL="bench@localhost",
               GIT_COMMITTER_NAME="bench", GIT_COMMITTER_EMAIL="bench@localhost")
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "generated"]):
        subprocess.run(["git"] + args, cwd=root, env=env, check=True)


def init_project(ferrus, root):
    ferrus.init_project(root, report=lambda message: None)
    # The files were written just now: age them as a checkout's files are, so the
    # incremental figure measures an edit, not the first minute after a checkout.
    old = time.time() - 3600
    for folder, _, names in os.walk(os.path.join(root, "src")):
        for name in names:
            os.utime(os.path.join(folder, name), (old, old))


# -- figures ------------------------------------------------------------------------------------

def measure(args, ferrus, graph):
    """(rows, values): each row (figure, what was measured, bar, ok — None for info)."""
    tmp = tempfile.mkdtemp(prefix="ferrus-graph-bench-")
    rows, values = [], {}
    try:
        reps = 1 if args.quick else 3
        root = os.path.join(tmp, "index")
        generate(root, args.files, 12)
        init_project(ferrus, root)
        store = ferrus.Store(root)
        fulls, cpus, incrementals, untouched = [], [], [], []
        target = os.path.join(root, "src", "pkg0", "mod0.py")
        for rep in range(reps):
            cpu = time.process_time()
            report = graph.graph_index(store, full=True)
            cpus.append(time.process_time() - cpu)
            fulls.append(report.seconds)
            for _ in range(5):
                with open(target, "a") as handle:
                    handle.write("\ndef added_%d_%d():\n    return 1\n" % (rep, len(incrementals)))
                started = time.perf_counter()
                changed = graph.graph_index(store)
                incrementals.append(time.perf_counter() - started)
                assert changed.extracted == 1, changed
            started = time.perf_counter()
            graph.graph_index(store)
            untouched.append(time.perf_counter() - started)
        values.update(full=fulls, full_cpu=cpus, incremental=incrementals, untouched=untouched,
                      files=report.files, symbols=report.symbols)
        full, incremental = statistics.median(fulls), statistics.median(incrementals)
        rows.append(("graph_index_full", "%d files, %d definitions: %.2f s (median of %d; "
                     "CPU time %.2f s — the machine's load shows in the difference)"
                     % (report.files, report.symbols, full, reps, statistics.median(cpus)),
                     "≤ %.0f s" % FULL_BAR, full <= FULL_BAR))
        rows.append(("graph_index_incremental", "one file changed: %.1f ms (median of %d); "
                     "nothing changed: %.1f ms" % (incremental * 1000, len(incrementals),
                                                   statistics.median(untouched) * 1000),
                     "≤ %.0f ms" % (INCREMENTAL_BAR * 1000), incremental <= INCREMENTAL_BAR))
        if hasattr(ferrus, "cmd_graph"):
            started = time.perf_counter()
            subprocess.run([sys.executable, args.ferrus, "graph", "index"], cwd=root,
                           check=True, stdout=subprocess.DEVNULL)
            rows.append(("graph_index_shell", "`ferrus graph index` typed in a shell, nothing "
                         "changed: %.1f ms" % ((time.perf_counter() - started) * 1000), "", None))

        big = os.path.join(tmp, "search")
        per_file = max(1, (100_000 + args.files - 1) // args.files - 3)
        generate(big, args.files, per_file)
        init_project(ferrus, big)
        big_store = ferrus.Store(big)
        report = graph.graph_index(big_store, full=True)
        queries = {"exact name": "item1234_5", "qualified": "Thing77.method77",
                   "prefix": "item99", "substring": "tem12_3", "words": "thing method",
                   "path": "src/pkg3/mod123", "no match": "nothing_like_this"}
        timings = {name: [] for name in queries}
        cpu_times = []
        view = graph.graph_open(big_store, refresh=False)
        try:
            for _ in range(5 if args.quick else 21):
                for name, query in queries.items():
                    cpu = time.process_time()
                    started = time.perf_counter()
                    graph.graph_search(view, query)
                    timings[name].append(time.perf_counter() - started)
                    cpu_times.append(time.process_time() - cpu)
        finally:
            view.close()
        medians = {name: statistics.median(times) for name, times in timings.items()}
        worst = max(medians.values())
        values.update(search_symbols=report.symbols, search=timings)
        rows.append(("graph_search", "%d definitions; median per kind of query: %s (CPU "
                     "time: median %.1f ms)" % (
                         report.symbols, ", ".join("%s %.1f ms" % (name, value * 1000)
                                                   for name, value in medians.items()),
                         statistics.median(cpu_times) * 1000),
            "≤ %.0f ms each" % (SEARCH_BAR * 1000), worst <= SEARCH_BAR))
        calls = []
        for _ in range(5 if args.quick else 21):
            started = time.perf_counter()
            graph.op_graph_search(big_store, ferrus.HUMAN, "item1234_5")
            calls.append(time.perf_counter() - started)
        rows.append(("graph_search_tool", "the whole repository_graph_search call (opening "
                     "the graph, its refresh every %.0f s included): median %.1f ms, max %.1f ms"
                     % (graph.GRAPH_REFRESH_SECS, statistics.median(calls) * 1000,
                        max(calls) * 1000), "", None))
    finally:
        if args.keep:
            print("kept: %s" % tmp, file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return rows, values


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--files", type=int, default=2000, help="generated files (2000)")
    parser.add_argument("--ferrus", default=DEFAULT_FERRUS, help="the ferrus.py to measure")
    parser.add_argument("--keep", action="store_true", help="keep the generated projects")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a bar is missed")
    args = parser.parse_args(argv)
    args.ferrus = os.path.abspath(args.ferrus)
    random.seed(0)
    ferrus, graph = load(args.ferrus)
    if graph is None:
        print("%s has no repository graph" % args.ferrus, file=sys.stderr)
        return 2
    rows, values = measure(args, ferrus, graph)
    if args.json:
        print(json.dumps({"python": sys.version.split()[0], "cpus": os.cpu_count(),
                          "rows": [{"figure": f, "measured": m, "bar": b,
                                    "result": "info" if ok is None else "PASS" if ok else
                                    "MISS"} for f, m, b, ok in rows], "values": values}))
    else:
        print("ferrus repository graph bench (Python %s, %d CPUs)" % (
            sys.version.split()[0], os.cpu_count() or 0))
        for figure, measured, bar, ok in rows:
            print("%-24s %-8s %s%s" % (figure, "" if ok is None else "PASS" if ok else "MISS",
                                       measured, "   [bar %s]" % bar if bar else ""))
    missed = any(ok is False for _, _, _, ok in rows)
    return 1 if missed and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
